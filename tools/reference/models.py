"""PyTorch twins of tensorshard's nn models, for tools/reference/make_parity.py.

Each twin has the same children, in the same registration order, as the C
module it mirrors, so that

  * construction draws the same random numbers in the same order
    (docs/rng.md §9): building it after torch.manual_seed(S)
    gives bit-identical parameters to the C model built after
    ts_manual_seed(S);
  * named_parameters() lists the same names in the same order as
    ts_module_named_parameters();
  * forward performs the same operations.

Twins:

  mlp(a, b, c)            ts_sequential_new({ts_linear_new(a, b), ts_relu_new,
                          ts_linear_new(b, c)})
  encoder(d, h, ff, n)    ts_transformer_encoder_new(cfg, n) with cfg =
                          ts_encoder_layer_config_default(d, h),
                          cfg.dim_feedforward = ff, cfg.dropout = 0,
                          cfg.batch_first = true
  GPT(cfg)                ts_gpt_new (nn/gpt.c)

Debian 12's python3-torch (1.13), run with /usr/bin/python3.
"""
import torch
import torch.nn as nn


def mlp(a, b, c):
    """nn.Sequential(Linear(a, b), ReLU(), Linear(b, c))."""
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))


def encoder(d_model, nhead, dim_feedforward, num_layers, norm_first=False, activation="relu"):
    """nn.TransformerEncoder of num_layers deep copies of one
    TransformerEncoderLayer (post-norm and relu unless told otherwise, eps
    1e-5, dropout 0, batch_first). Run it in train mode: in eval mode torch 1.13 may take
    the fused "fast path" (torch._transformer_encoder_layer_fwd), whose
    arithmetic differs from the composite one that nn/encoder_layer.c
    mirrors."""
    layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=dim_feedforward, dropout=0.0,
                                       activation=activation, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, num_layers)


class Block(nn.Module):
    """nn/gpt.c's block: pre-norm attention and MLP, each with a residual.

        x = x + attn(ln1(x), ln1(x), ln1(x), attn_mask=mask)
        x = x + mlp(ln2(x))

    Construction order (it fixes the random draws): ln1 (no draws), attn
    (out_proj Linear, then xavier_uniform_ of in_proj_weight), ln2, mlp
    (Linear(d, 4d), GELU, Linear(4d, d), Dropout)."""

    def __init__(self, d_model, n_head, dropout, gelu_approx="none"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = nn.MultiheadAttention(d_model, n_head, dropout=dropout, bias=True, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate=gelu_approx),
                                 nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x, mask):
        h = self.ln1(x)
        # need_weights=False: nn/mha.c returns no attention weights. In
        # train mode MultiheadAttention never takes its fused fast path.
        a = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nn/gpt.c's ts_gpt_new: tok_emb, pos_emb, drop, blocks, ln_f,
    lm_head (bias-free; with tie_weights its weight is tok_emb.weight, the
    draws of its own initialisation being consumed first, as in C).
    gelu_approx "tanh" is cfg.gelu_approx = TS_GELU_TANH (GPT-2's)."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, d_model, dropout=0.0, tie_weights=False,
                 gelu_approx="none"):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_head, dropout, gelu_approx) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx):
        """idx: int64 (B, T), T <= block_size -> logits (B, T, vocab)."""
        T = idx.size(1)
        assert 1 <= T <= self.block_size
        pos = torch.arange(0, T, dtype=torch.int64)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        # bool (T, T), true above the diagonal = may not attend (ts__causal_mask)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        for b in self.blocks:
            x = b(x, mask)
        return self.lm_head(self.ln_f(x))
