"""Training through pyattn: a ``torch.autograd.Function`` around ``pyattn.attention`` and
``pyattn.attention_backward``, in a tiny causal transformer.

1. The Function's forward calls ``pyattn.attention(q, k, v, causal=True, return_lse=True)`` on the
   torch tensors as they are (bf16, (batch, seq, heads, head_dim) views of one projection, run on
   torch's current stream) and keeps the output and its log-sum-exp for the backward, which calls
   ``pyattn.attention_backward(dout, q, k, v, out, lse, causal=True)``. pyattn's results come back
   to torch zero-copy with ``torch.from_dlpack``.
2. The same model (same initial weights, same batches) is trained twice for a few hundred AdamW
   steps on next-token prediction over a random Markov chain: once with this Function, once with
   torch's ``scaled_dot_product_attention``. The two loss curves must agree: their largest
   relative difference at any step is printed and must stay under ``BOUND`` (both use bf16
   attention; the rest of the model is fp32), and both must have learned.

Run (pyattn and torch with CUDA installed): ``python examples/train_tiny.py``.
Exit status 0 on success (or ``skipped: ...`` without torch or a GPU), 1 with ``FAILED: ...``.
"""

import importlib.util
import sys

import numpy as np

try:
    import pyattn
except ImportError as exc:
    sys.exit(f"error: cannot import pyattn ({exc}); run `pip install -e .` in the repository first")

STEPS, BATCH, SEQ, VOCAB, DIM, HEADS, LAYERS, LR = 300, 16, 128, 64, 128, 4, 2, 3e-3
BOUND = 0.05  # largest relative difference between the two loss curves at any step


def check(ok, what):
    if not ok:
        sys.exit(f"FAILED: {what}")
    print(f"ok    {what}")


def main():
    if importlib.util.find_spec("torch") is None:
        print("skipped: torch is not installed (pip install torch)")
        return
    if pyattn.device_count() == 0:
        print("skipped: no CUDA GPU (pyattn.device_count() == 0)")
        return
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("skipped: no CUDA GPU visible to torch")
        return

    class PyattnAttention(torch.autograd.Function):
        """Causal attention on (B, S, H, D) tensors through pyattn, forward and backward."""

        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = pyattn.attention(q, k, v, causal=True, return_lse=True)
            out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            grads = pyattn.attention_backward(dout.contiguous(), q, k, v, out, lse, causal=True)
            return tuple(torch.from_dlpack(g) for g in grads)

    def sdpa(q, k, v):
        t = lambda x: x.transpose(1, 2)  # noqa: E731 - SDPA takes (B, H, S, D)
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
            self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                                           torch.nn.Linear(4 * DIM, DIM))

        def forward(self, x, attn):
            b, s, _ = x.shape
            qkv = self.qkv(self.ln1(x)).to(torch.bfloat16).view(b, s, 3, HEADS, DIM // HEADS)
            x = x + self.proj(attn(*qkv.unbind(2)).reshape(b, s, DIM).float())
            return x + self.mlp(self.ln2(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(SEQ, DIM)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln, self.head = torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, VOCAB)

        def forward(self, idx, attn):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x, attn)
            return self.head(self.ln(x))

    # Data: a random Markov chain where each token has 4 equally likely successors (loss floor ln 4).
    g = torch.Generator(device="cuda").manual_seed(1)
    succ = torch.randint(VOCAB, (VOCAB, 4), device="cuda", generator=g)
    tokens = torch.empty(STEPS * BATCH, SEQ + 1, dtype=torch.long, device="cuda")
    tokens[:, 0] = torch.randint(VOCAB, (STEPS * BATCH,), device="cuda", generator=g)
    for i in range(SEQ):
        pick = torch.randint(4, (STEPS * BATCH,), device="cuda", generator=g)
        tokens[:, i + 1] = succ[tokens[:, i], pick]

    def train(attn):
        torch.manual_seed(0)
        model = Model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            batch = tokens[step * BATCH:(step + 1) * BATCH]
            logits = model(batch[:, :-1], attn)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses)

    ref, mine = train(sdpa), train(PyattnAttention.apply)
    for step in (0, 1, 10, 50, 100, 200, STEPS - 1):
        print(f"      step {step:3d}: loss SDPA {ref[step]:.4f}  pyattn {mine[step]:.4f}")
    rel = float(np.max(np.abs(mine - ref) / ref))
    check(np.isfinite(mine).all(), "every pyattn loss is finite")
    check(rel <= BOUND, f"loss curves agree: max relative difference {rel:.2e} <= {BOUND}")
    floor = float(np.log(4))
    check(mine[-1] < floor + 0.5 and ref[-1] < floor + 0.5,
          f"both learned: final loss {mine[-1]:.3f} / {ref[-1]:.3f} (from {ref[0]:.3f}; floor ln 4 = {floor:.3f})")


if __name__ == "__main__":
    main()
