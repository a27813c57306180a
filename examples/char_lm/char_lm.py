"""A character-level language model (a few GPT blocks, as in nanoGPT) on text that ships with Python, trained by
hvd-train: next-character cross-entropy, reported as loss and perplexity. Nothing here knows about Horovod.
"""
import inspect
import math
import textwrap

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


def shipped_text():
    """The source of Python's textwrap module: some 20,000 characters of English and code, on every machine."""
    return inspect.getsource(textwrap)


class Windows(Dataset):
    """Every block_size-long window of `ids` that starts at a multiple of `stride`: (input, next characters)."""

    def __init__(self, ids, block_size, stride):
        self.ids, self.block_size = ids, block_size
        self.starts = range(0, len(ids) - block_size - 1, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, index):
        start = self.starts[index]
        chunk = self.ids[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def datasets(block_size=32, stride=4, val_share=0.1):
    """--dataset char_lm:datasets. The first 90% of the text trains, the rest validates; the facts tell the model
    the vocabulary and the context length."""
    text = shipped_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - val_share))
    facts = {"vocab_size": len(vocab), "block_size": block_size}
    return Windows(ids[:cut], block_size, stride), Windows(ids[cut:], block_size, stride), facts


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=2, n_head=2, n_embd=64):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln(self.blocks(self.tokens(ids) + self.positions(positions))))


def model(vocab_size, block_size, n_layer=2, n_head=2, n_embd=64):
    """--model char_lm:model. vocab_size and block_size come from the data set; the rest from --model-args."""
    return CharGPT(vocab_size, block_size, n_layer, n_head, n_embd)


class NextCharacter:
    """--task char_lm:NextCharacter. Cross-entropy per character; perplexity is exp of an epoch's mean loss."""
    derived = ("ppl",)
    best_metric, best_mode = "val_loss", "min"

    def loss(self, model, batch):
        inputs, targets = batch
        logits = model(inputs)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten())}, logits

    def derive(self, means):
        return {"ppl": math.exp(min(means["loss"], 50.0))}
