"""Whether three training-step idioms can be held by a CUDA graph, bit for bit, on this GPU.

Each probe builds the step with plain PyTorch (no Lightning; of l2lightning only its generator
put-back, ``l2lightning.graph.rng.put_back_cuda_rng``), runs it eagerly from a saved state, captures it in
``torch.cuda.graph`` and replays it from the same state, and compares every parameter, gradient and
carried tensor bitwise. Each probe runs in its own process (a failed capture leaves the CUDA
generator unusable):

* ``lstm``: a word-language-model step (``nn.Embedding`` -> 2-layer cuDNN ``nn.LSTM`` with dropout
  between layers -> ``nn.Linear``), the hidden state carried across steps and detached
  (pytorch/examples ``word_language_model``'s ``repackage_hidden``), SGD with momentum and value
  clipping, cuDNN's dropout-state buffer saved and put back with the rest; also without saving that
  buffer, with the generator put back by ``torch.cuda.set_rng_state`` (which makes cuDNN re-seed:
  a host sync inside the capture), with ``dropout=0``, and a GRU;
* ``checkpoint``: a block with dropout under ``torch.utils.checkpoint`` (``use_reentrant=False``,
  ``preserve_rng_state=True``), whose backward recomputes the forward's dropout;
* ``amp_fused``: ``GradScaler`` with a fused AdamW under fp16 autocast, ``scaler.scale(loss).backward()``,
  ``scaler.step``, ``scaler.update``, including a step whose gradients overflow.

Writes ``probe_capture_idioms.json`` under ``--out``. Usage:
``python3 benchmarks/probe_capture_idioms.py --out OUTDIR``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from l2lightning.graph.rng import put_back_cuda_rng
from l2lightning.guards.step_trace import cudnn_dropout_state


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()  # a 0-dim view fails
    return bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone_tree(v) for v in x)
    return x


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(v)]
    return []


class _State:
    """Parameters, optimizer state and CUDA RNG, saved and put back in place."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, extra=()) -> None:
        self.params = [(p, p.detach().clone()) for p in model.parameters()]
        self.opt = {
            id(p): {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for p, s in opt.state.items()
        }
        self.extra = [(t, t.detach().clone()) for t in extra]
        self.rng = torch.cuda.get_rng_state()
        # torch.cuda.set_rng_state (like set_offset and manual_seed) makes cuDNN re-seed its RNN
        # dropout state at the next call, a host sync and a draw; put_back_cuda_rng sets the state
        # through a second generator on the same state object, which leaves the re-seed flag alone
        self.restore_with = "put_back"

    def restore(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for live, saved in self.params + self.extra:
                live.copy_(saved)
            for p, s in opt.state.items():
                for k, v in s.items():
                    if isinstance(v, torch.Tensor):
                        v.copy_(self.opt[id(p)][k])
        if self.restore_with == "set_rng_state":
            torch.cuda.set_rng_state(self.rng)
        else:
            put_back_cuda_rng([(torch.cuda.current_device(), self.rng)])


def _compare(model, opt, got, want) -> list[str]:
    diffs = []
    for name, a, b in zip(got["names"], got["tensors"], want["tensors"]):
        if not _bits_equal(a, b):
            diffs.append(name)
    return diffs


def _snapshot(model, opt, carried) -> dict:
    names, tensors = [], []
    for n, p in model.named_parameters():
        names.append(n)
        tensors.append(p.detach().clone())
        names.append(n + ".grad")
        tensors.append(p.grad.detach().clone() if p.grad is not None else torch.zeros(0, device=p.device))
    for i, t in enumerate(_flat(carried)):
        names.append(f"carried[{i}]")
        tensors.append(t.detach().clone())
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                names.append(f"opt.{k}")
                tensors.append(v.detach().clone())
    return {"names": names, "tensors": tensors}


class WordLM(nn.Module):
    def __init__(self, ntoken=1000, ninp=128, nhid=128, nlayers=2, dropout=0.2, cell="LSTM") -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, cell)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.cell, self.nlayers, self.nhid = cell, nlayers, nhid

    def init_hidden(self, bsz: int):
        w = next(self.parameters())
        if self.cell == "LSTM":
            return (w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid))
        return w.new_zeros(self.nlayers, bsz, self.nhid)

    def forward(self, x, hidden):
        emb = self.drop(self.encoder(x))
        out, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(out)), hidden


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


class _DropoutStateFinder(TorchDispatchMode):
    """The cuDNN RNN dropout-state buffer the step's ``_cudnn_rnn`` calls read and advance."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = cudnn_dropout_state(func, args, kwargs)
        if state is not None:
            self.found[state.untyped_storage().data_ptr()] = state
        return func(*args, **kwargs)


def probe_rnn(
    cell: str, dropout: float, steps: int = 6, restore_with: str = "put_back", save_dropout_state: bool = True
) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = WordLM(dropout=dropout, cell=cell).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bptt, bsz = 35, 8
    data = torch.randint(0, 1000, (steps + 8, bptt + 1, bsz), device=dev)
    crit = nn.CrossEntropyLoss()
    holder = {"hidden": model.init_hidden(bsz)}

    def step(x, y):
        holder["hidden"] = repackage_hidden(holder["hidden"])
        out, holder["hidden"] = model(x, holder["hidden"])
        loss = crit(out.view(-1, 1000), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.25)
        opt.step()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):  # warm-up (and momentum buffers made)
            step(data[i, :-1], data[i, 1:])
        finder = _DropoutStateFinder()
        with finder:
            step(data[2, :-1], data[2, 1:])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dropout_states = list(finder.found.values())
    result: dict = {
        "cell": cell,
        "dropout": dropout,
        "dropout_state_bytes": [t.numel() for t in dropout_states],
    }
    static_x = data[3, :-1].clone()
    static_y = data[3, 1:].clone()
    # the carried state the graph reads: static buffers; the step rebinds holder["hidden"] to its output
    static_h = _clone_tree(holder["hidden"])
    h_start = _clone_tree(holder["hidden"])
    kept = dropout_states if save_dropout_state else []
    saved = _State(model, opt, extra=[*_flat(static_h), *kept])
    saved.restore_with = restore_with
    result["restore_with"] = restore_with
    result["dropout_state_saved"] = bool(kept)

    def run_eager():
        saved.restore(model, opt)
        holder["hidden"] = _clone_tree(h_start)
        losses = [step(data[3 + i, :-1], data[3 + i, 1:]).detach().clone() for i in range(steps)]
        torch.cuda.synchronize()
        return losses, _snapshot(model, opt, holder["hidden"])

    eager_losses, want = run_eager()
    eager_again_losses, want_again = run_eager()
    # cuDNN keeps its dropout state in a process-wide buffer outside torch's generator: two eager runs
    # from the same torch RNG state may draw other masks
    result["eager_repeatable"] = not _compare(model, opt, want_again, want) and all(
        _bits_equal(a, b) for a, b in zip(eager_losses, eager_again_losses)
    )
    saved.restore(model, opt)
    graph = torch.cuda.CUDAGraph()
    holder["hidden"] = static_h
    try:
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = step(static_x, static_y)
        out_h = holder["hidden"]
    except Exception as exc:  # noqa: BLE001 -- the probe reports what failed
        result["captured"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        result["where"] = traceback.format_exc().splitlines()[-6:]
        return result
    result["captured"] = True

    def run_graph():
        saved.restore(model, opt)
        losses = []
        carry = _clone_tree(h_start)
        for i in range(steps):
            static_x.copy_(data[3 + i, :-1])
            static_y.copy_(data[3 + i, 1:])
            for dst, src in zip(_flat(static_h), _flat(carry)):
                dst.copy_(src)  # the previous step's hidden state into the buffer the graph reads
            graph.replay()
            losses.append(static_loss.detach().clone())
            carry = out_h  # the graph's output is the next step's input
        torch.cuda.synchronize()
        return losses, _snapshot(model, opt, out_h)

    graph_losses, got = run_graph()
    graph_again_losses, got_again = run_graph()
    result["graph_repeatable"] = not _compare(model, opt, got_again, got) and all(
        _bits_equal(a, b) for a, b in zip(graph_losses, graph_again_losses)
    )
    result["losses_equal"] = all(_bits_equal(a, b) for a, b in zip(graph_losses, eager_losses))
    result["first_loss_diff"] = next(
        (i for i, (a, b) in enumerate(zip(graph_losses, eager_losses)) if not _bits_equal(a, b)), None
    )
    result["differing"] = _compare(model, opt, got, want)[:8]
    result["bitwise"] = result["losses_equal"] and not result["differing"]
    return result


class CheckpointedBlock(nn.Module):
    def __init__(self, width=256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(width, width)

    def inner(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=True)


def _graph_against_eager(model, opt, step, xs: torch.Tensor, steps: int, extra=()) -> dict:
    """Warm `step` up on a side stream, run `steps` eager steps from a saved state, capture one step
    and replay it `steps` times from the same state; losses and state (with `extra`) compared bitwise."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            step(xs[i])
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    extra = list(extra)  # state the warm-up made (a GradScaler's scale)
    saved = _State(model, opt, extra=extra)
    eager = [step(xs[3 + i]).detach().clone() for i in range(steps)]
    torch.cuda.synchronize()
    want = _snapshot(model, opt, extra)
    saved.restore(model, opt)
    static_x = xs[3].clone()
    graph = torch.cuda.CUDAGraph()
    try:
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = step(static_x)
    except Exception as exc:  # noqa: BLE001 -- the probe reports what failed
        return {
            "captured": False,
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
            "where": traceback.format_exc().splitlines()[-8:],
        }
    saved.restore(model, opt)
    replayed = []
    for i in range(steps):
        static_x.copy_(xs[3 + i])
        graph.replay()
        replayed.append(static_loss.detach().clone())
    torch.cuda.synchronize()
    got = _snapshot(model, opt, extra)
    result = {
        "captured": True,
        "losses_equal": all(_bits_equal(a, b) for a, b in zip(replayed, eager)),
        "differing": _compare(model, opt, got, want)[:8],
    }
    result["bitwise"] = result["losses_equal"] and not result["differing"]
    return result


def probe_checkpoint(steps: int = 6) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(CheckpointedBlock(), CheckpointedBlock(), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    xs = torch.randn(steps + 4, 16, 256, device=dev)

    def step(x):
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return _graph_against_eager(model, opt, step, xs, steps)


class _ScalerState:
    """A GradScaler's device state as a list the probe saves and compares, read when first iterated
    (after the warm-up steps have made it)."""

    def __init__(self, scaler) -> None:
        self.scaler = scaler

    def __iter__(self):
        return iter([self.scaler._scale, self.scaler._growth_tracker])


def probe_amp_fused(steps: int = 6) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2)
    xs = torch.randn(steps + 4, 16, 256, device=dev)
    xs[5] *= 1e30  # an fp16 overflow at that step: the update is skipped and the scale halves

    def step(x):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    # the scaler's scale and growth tracker are made at its first use: warmed up by the helper, read then
    extra = _ScalerState(scaler)
    result = _graph_against_eager(model, opt, step, xs, steps, extra=extra)
    result["scale_after"] = float(scaler._scale)
    return result


PROBES = {
    "lstm_dropout": lambda: probe_rnn("LSTM", 0.2),
    "lstm_dropout_state_not_saved": lambda: probe_rnn("LSTM", 0.2, save_dropout_state=False),
    "lstm_dropout_set_rng_state": lambda: probe_rnn("LSTM", 0.2, restore_with="set_rng_state"),
    "lstm_no_dropout": lambda: probe_rnn("LSTM", 0.0),
    "gru_dropout": lambda: probe_rnn("GRU", 0.2),
    "checkpoint_dropout": probe_checkpoint,
    "amp_fused_adamw": probe_amp_fused,
}


def run_one(name: str) -> dict:
    started = time.perf_counter()
    try:
        result = PROBES[name]()
    except Exception as exc:  # noqa: BLE001 -- the probe reports what failed
        result = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc().splitlines()[-8:]}
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (all probes, each in its own process)")
    parser.add_argument("--only", choices=sorted(PROBES), help="run one probe here and print its JSON line")
    args = parser.parse_args()
    if args.only:
        print("RESULT " + json.dumps(run_one(args.only)), flush=True)
        return
    if not args.out:
        parser.error("--out is required unless --only is given")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "cudnn": torch.backends.cudnn.version(),
        "command": "python3 benchmarks/probe_capture_idioms.py --out OUTDIR",
    }
    for name in PROBES:
        # its own process: a capture that fails leaves the CUDA generator unusable for the next probe
        done = subprocess.run(
            [sys.executable, __file__, "--only", name], capture_output=True, text=True, timeout=300
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results[name] = (
            json.loads(lines[-1][len("RESULT ") :])
            if lines
            else {"error": f"exit {done.returncode}", "stderr": done.stderr.splitlines()[-8:]}
        )
        print(name, json.dumps(results[name]), flush=True)
    (out / "probe_capture_idioms.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
