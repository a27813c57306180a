"""The commands around training (hvd-train doctor, shard, export, predict) and the inference they share."""
