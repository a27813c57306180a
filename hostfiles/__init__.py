"""Host lists: hostfiles and elastic discovery (scripts), read by one parser (validate.parse)."""
