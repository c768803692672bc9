"""The routed experts of a batched torch peer: B rows, each with its top-k experts of a stacked [E, ...] tensor.

Two paths, both free of host syncs and of data-dependent shapes (a chain captures as a CUDA graph):

* ``grouped``: the B * top_k (row, expert) pairs sorted by expert, int32 group ends from `searchsorted`, two
  ``torch._grouped_mm`` over the stacked weights; an expert no row chose is an empty group, so each distinct
  selected expert's weights are read once per step however many rows chose it.
* ``gather``: each row's top-k experts copied out of the stack (``w13[idx]``) and applied to that row, one row
  at a time; an expert chosen by several rows is read again for each. At B = 1 this is exactly the batch-1
  peer's op.

`pick_path` decides; `RoutedMoE.use_gather` switches a built peer over (the bench does so when the grouped
path fails eagerly or at capture). torch is imported inside the functions."""
from __future__ import annotations

from .common import routed, swiglu

MOE_PATHS = ("auto", "grouped", "gather")
_PROBED: dict = {}


def grouped_mm_works(device: str) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` runs bf16 on `device` (a small probe checked against matmuls, cached).

    Parameters
    ----------
    device : str
        A torch device ("cpu", "cuda", ...).

    Returns
    -------
    (bool, str)
        It works, and why not (or which torch has it).
    """
    import torch
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    if device not in _PROBED:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(24, 64, generator=g, device=device).to(torch.bfloat16)
            w = torch.randn(3, 32, 64, generator=g, device=device).to(torch.bfloat16)
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)    # the middle group is empty
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float()
            ref = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T]).float()
            ok = bool(torch.allclose(y, ref, rtol=2e-2, atol=2e-1))
            _PROBED[device] = (ok, f"torch {torch.__version__} torch._grouped_mm" if ok else
                               f"torch._grouped_mm on {device} gave wrong results in a probe")
        except Exception as e:    # noqa: BLE001  (no kernel for this device or dtype)
            _PROBED[device] = (False, f"torch._grouped_mm on {device}: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:120] if str(e) else ''}")
    return _PROBED[device]


def pick_path(path: str, batch: int, device: str) -> tuple[str, str]:
    """The MoE path a peer of `batch` rows runs, and why.

    Parameters
    ----------
    path : {"auto", "grouped", "gather"}
        Asked for. "auto": gather at batch 1 (one row's experts are distinct; the batch-1 peer's ops), else
        grouped when `grouped_mm_works`, else gather.
    batch : int
        Rows per step.
    device : str
        The torch device.
    """
    if path not in MOE_PATHS:
        raise ValueError(f"MoE path {path!r}: one of {MOE_PATHS}")
    if path == "gather":
        return "gather", "gather asked for"
    if path == "auto" and batch == 1:
        return "gather", "batch 1: the row's top-k experts gathered (distinct already)"
    ok, why = grouped_mm_works(device)
    return ("grouped", why) if ok else ("gather", f"{why}; gathering each row's experts instead")


class RoutedMoE:
    """sum_k w[b, k] E_{idx[b, k]}(xn[b]) for B rows, by the path `pick_path` chose.

    Parameters
    ----------
    w13, w2 : torch.Tensor
        The stacked experts, [E, 2I, D] ([gate; up]) and [E, D, I], bf16.
    top_k : int
        Experts per row.
    batch : int
        Rows per step.
    limit : float, optional
        The SwiGLU clamp (DeepSeek-V4).
    path : {"auto", "grouped", "gather"}, default "auto"
        See `pick_path`.

    Attributes
    ----------
    path, reason : str
        The path that runs and why.
    last : torch.Tensor or None
        The newest call's expert ids [B, top_k] (on the device; under a CUDA graph, the last replay's).
    expert_bytes : int
        bf16 bytes of one expert (gate, up and down).
    """

    def __init__(self, w13, w2, top_k: int, batch: int, limit: float | None = None, path: str = "auto"):
        import torch
        self.torch, self.w13, self.w2, self.top_k, self.batch, self.limit = torch, w13, w2, top_k, batch, limit
        self.n_experts = w13.shape[0]
        self.path, self.reason = pick_path(path, batch, str(w13.device))
        self.groups = torch.arange(self.n_experts, device=w13.device)
        self.last = None
        self.expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()

    def use_gather(self, reason: str) -> None:
        """Run the gather path from now on (the grouped one failed: `reason`)."""
        self.path, self.reason = "gather", reason

    def __call__(self, xn, idx, w):
        """[B, D] f32 of xn [B, D] bf16, expert ids idx [B, top_k], weights w [B, top_k] f32."""
        self.last = idx
        if self.path == "grouped":
            return self._grouped(xn, idx, w)
        ys = [routed(xn[b:b + 1], self.w13[idx[b]], self.w2[idx[b]], w[b], self.limit) for b in range(len(idx))]
        return ys[0] if len(ys) == 1 else self.torch.cat(ys)

    def _grouped(self, xn, idx, w):
        torch = self.torch
        B, K = idx.shape
        se, order = idx.reshape(-1).sort(stable=True)                          # pairs by expert
        offs = torch.searchsorted(se, self.groups, right=True, out_int32=True)  # group ends [E]
        xs = xn.index_select(0, order // K)
        a = swiglu(torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs), self.limit)    # [BK, I]
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)                           # [BK, D]
        y = torch.empty_like(y).index_copy_(0, order, y)                       # back to (row, slot) order
        return (y.view(B, K, -1).float() * w[..., None]).sum(1)

    def distinct(self) -> int | None:
        """Distinct experts the newest call selected (read back from the device), or None before any call."""
        return None if self.last is None else int(self.last.unique().numel())

    def expected_distinct(self) -> int:
        """Distinct experts B rows select under uniform routing: E (1 - (1 - k/E)^B) (k at B = 1)."""
        E, K = self.n_experts, self.top_k
        return K if self.batch == 1 else round(E * (1 - (1 - K / E) ** self.batch))
