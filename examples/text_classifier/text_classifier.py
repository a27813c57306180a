"""A small transformer text classifier trained by hvd-train with its default task (classification): the samples are
dicts {input_ids, attention_mask, label}, and the model is called with the ids and the mask by keyword, as
HuggingFace models are. Nothing here knows about Horovod.

The data are generated reviews of a few words each: neutral words, `opinions` sentiment words, and "not", which
turns the sentiment of the word after it. The label is the sign of the sum (positive or negative): spotting the
sentiment words is not enough, the model has to read each "not" with its neighbour.
"""
import torch
from torch import nn
from torch.utils.data import Dataset

PAD, NOT = 0, 1
POSITIVE = ["good", "great", "fine", "superb", "lovely", "clever", "fresh", "warm"]
NEGATIVE = ["bad", "awful", "dull", "poor", "stale", "weak", "boring", "cold"]
NEUTRAL = ["the", "a", "film", "plot", "cast", "was", "and", "very", "is", "it", "story", "music", "but", "quite",
           "really", "ending"]
WORDS = ["<pad>", "not"] + POSITIVE + NEGATIVE + NEUTRAL
CLASSES = ["negative", "positive"]


class Reviews(Dataset):
    """`count` reviews of min_len to max_len words (padded to max_len), drawn from `seed`: the same on every rank
    and every run. Each sample: {"input_ids": int64 [max_len], "attention_mask": int64 [max_len] (1 for words, 0 for
    padding), "label": 0 or 1}."""

    def __init__(self, count, max_len, min_len, opinions, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.full((count, max_len), PAD, dtype=torch.long)
        self.mask = torch.zeros(count, max_len, dtype=torch.long)
        self.labels = torch.zeros(count, dtype=torch.long)
        first_positive, first_neutral = 2, 2 + len(POSITIVE) + len(NEGATIVE)
        for i in range(count):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            words = torch.randint(first_neutral, len(WORDS), (length,), generator=g)
            score = 0
            while score == 0:  # a tie has no label: drawn again
                slots = torch.randperm(length - 1, generator=g)[:opinions] + 1  # room for a "not" before each
                sentiment = torch.randint(first_positive, first_neutral, (opinions,), generator=g)
                negated = torch.rand(opinions, generator=g) < 0.4
                score = sum((1 if int(w) < 2 + len(POSITIVE) else -1) * (-1 if n else 1)
                            for w, n in zip(sentiment, negated))
            words[slots] = sentiment
            words[slots[negated] - 1] = NOT
            self.ids[i, :length], self.mask[i, :length], self.labels[i] = words, 1, int(score > 0)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "label": self.labels[index]}


def datasets(num_train=4000, num_val=1000, max_len=16, min_len=5, opinions=1, seed=0):
    """--dataset text_classifier:datasets. Training and validation reviews from different seeds; the facts tell the
    model the vocabulary, the classes and the longest review."""
    facts = {"vocab_size": len(WORDS), "num_classes": len(CLASSES), "max_len": max_len, "classes": CLASSES}
    train = Reviews(num_train, max_len, min_len, opinions, seed)
    return train, Reviews(num_val, max_len, min_len, opinions, seed + 1), facts


class TextClassifier(nn.Module):
    """Token and position embeddings, a pre-norm nn.TransformerEncoder that ignores the padding, the mean over the
    words, and a linear head."""

    def __init__(self, vocab_size, num_classes, max_len, d_model=64, n_layers=2, n_heads=4, dropout=0.1):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        # enable_nested_tensor=False: the packed fast path for padding is an inference shortcut that torch.export
        # (and so ONNX export) cannot capture.
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * weights).sum(1) / weights.sum(1).clamp(min=1.0))


def model(vocab_size, num_classes, max_len, d_model=64, n_layers=2, n_heads=4, dropout=0.1):
    """--model text_classifier:model. vocab_size, num_classes and max_len come from the data set's facts; the rest
    from --model-args."""
    return TextClassifier(vocab_size, num_classes, max_len, d_model, n_layers, n_heads, dropout)


def bert(vocab_size, num_classes, max_len, d_model=64, n_layers=2, n_heads=4, dropout=0.1):
    """--model text_classifier:bert. HuggingFace's BertForSequenceClassification, built from a small config (no
    download), with the same --model-args as the model above. It takes input_ids and attention_mask by keyword and
    returns an output object with .logits, which the default task reads."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
                        num_attention_heads=n_heads, intermediate_size=4 * d_model, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, max_position_embeddings=max_len,
                        num_labels=num_classes, pad_token_id=PAD)
    return BertForSequenceClassification(config)
