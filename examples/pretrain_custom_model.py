"""White box: a PreTrainer subclass around your own torch model and dataset.

    rapidlite --user-script examples/pretrain_custom_model.py --train-iters 200 \
        --micro-batch-size 8 --global-batch-size 32 --lr 3e-3 --lr-warmup-iters 20 --lr-decay-style cosine

(or ``python examples/pretrain_custom_model.py <same flags>``). The model is a small causal transformer
built from torch modules; the data is a synthetic token stream with structure to learn (each sequence
counts upward from a random start, modulo the vocabulary). The forward step returns
``(loss_sum, num_tokens)`` so gradient accumulation weights every token equally.
"""

import torch
import torch.nn.functional as F
from torch import nn

from rapidlite import PreTrainer, RapidliteEngine, get_args


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, vocab_size, (num_samples,), generator=g)
        self.seq_length, self.vocab_size = seq_length, vocab_size

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        return {"text": (self.starts[i] + torch.arange(self.seq_length + 1)) % self.vocab_size}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        # No q/k/v bias: a key bias shifts all scores of a query equally, so softmax makes its gradient zero
        # and the optimizer would only amplify rounding noise.
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.heads, self.dropout = heads, nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.mlp(self.ln2(x)))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int, dropout: float = 0.1):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MyPreTrainer(PreTrainer):
    vocab_size = 64

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        seq = args.seq_length or 32
        train, valid, test = (
            CountingDataset(max(n, 1), seq, self.vocab_size, seed=args.seed + i)
            for i, n in enumerate(train_val_test_num_samples)
        )
        return train, valid, test

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = TinyCausalLM(
            self.vocab_size,
            args.hidden_size or 64,
            args.num_layers or 2,
            args.num_attention_heads or 4,
            args.seq_length or 32,
        )
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        tokens = next(data_iterator)["text"]
        logits = model(tokens[:, :-1])
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        return loss_sum, tokens[:, 1:].numel()


if __name__ == "__main__":
    engine = RapidliteEngine()
    trainer = MyPreTrainer(engine=engine)
    trainer.train()
