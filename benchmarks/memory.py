"""Memory and step-time overhead of `potluck.Optimizer` on a 100M-parameter transformer (issue 12).

A small GPT-style model (12 pre-norm layers, d=768, 12 heads, vocabulary 16,384 tied with the output
layer: 98M float32 parameters, 373 MiB), trained by one peer on random tokens (1 sequence of 32
tokens per step, so that it runs on 2 cores). Each case runs in its own process, so its peak RSS
(ru_maxrss) is its own:

  adam         plain torch.optim.Adam (lr 1e-4): forward, backward, step, zero_grad
  sync         potluck.Optimizer(mode="sync") around the same Adam, a lone peer; target_batch_size
               = one step's batch, so every step() closes an epoch (gradients in, the update out)
  diloco       potluck.Optimizer(mode="diloco", local_steps=2): every second step() is an outer step
  newcomer     a donor process (sync Optimizer, serving its state) and a newcomer that builds the
               same model and downloads the state when it creates its Optimizer (load_state=True)
  newcomer_no_download   the newcomer without the download (load_state=False): the Optimizer's own
               buffers, so that the download's share of the newcomer's peak is the difference

Figures (one JSON object per line):
  peak_rss            MB, per case; extra_over_adam_models = (peak - adam's peak) / model size
  newcomer_peak       the newcomer's peak RSS over its RSS with the model alone, in model sizes;
                      downloaded: whether its parameters are the donor's afterwards
  newcomer_download_peak  the same when the download ends (before the Optimizer allocates its
                      gradient accumulator)
  step_time           opt.step() alone (median over the steps after the first), and its ratio to
                      Adam's step: step_overhead_ratio

Usage: python benchmarks/memory.py [--quick] [--steps 5]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

from peer_processes import Worker
from soak import rss_mb
from training import ROOT, STARTUP_TIMEOUT, WORKER_IDLE_TIMEOUT, emit, read_line, say

FULL = {"layers": 12, "d": 768, "heads": 12, "vocab": 16384}  # 98M parameters
QUICK = {"layers": 4, "d": 384, "heads": 6, "vocab": 8192}  # 10M: --quick
SEQUENCE = 32  # tokens per step, one sequence: enough for every layer to run, light for 2 cores
LR = 1e-4
DILOCO_LOCAL_STEPS = 2  # an outer step every second step() among the few measured
MATCHMAKING_TIME = 0.2  # s; a lone peer's outer step waits this for partners that never come
DONOR_SHIFT = 1.0  # the donor's parameters are the model's plus this: the newcomer can tell it downloaded them
CASE_TIMEOUT = 600.0  # s for one case's steps (the full model on a loaded 2-core machine)
CASES = ("adam", "sync", "diloco", "newcomer_no_download", "newcomer")


def make_transformer(layers: int, d: int, heads: int, vocab: int) -> Any:
    import torch

    class GPT(torch.nn.Module):
        """Token embedding, pre-norm causal transformer layers, output tied to the embedding."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.position = torch.nn.Parameter(torch.zeros(SEQUENCE, d))
            layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
            h = self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]], mask=mask, is_causal=True)
            return self.norm(h) @ self.embed.weight.T

    torch.manual_seed(0)
    return GPT()


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# == worker processes =============================================================================
def run_worker(args: argparse.Namespace) -> None:
    import torch

    import potluck  # in every case, Adam's too: the same imported code on every baseline
    torch.set_num_threads(1)
    model = make_transformer(**(QUICK if args.quick else FULL))
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    baseline = rss_mb()
    make_adam = lambda p: torch.optim.Adam(p, LR)  # noqa: E731
    download_peaks: list[float] = []
    first = next(model.parameters())
    before = float(first.mean())
    if args.worker == "donor":
        with torch.no_grad():
            first.add_(DONOR_SHIFT)
    if args.worker == "adam":
        opt, closers = make_adam(model.parameters()), []
    else:
        if args.worker == "newcomer":  # the peak at the end of the download, before the Optimizer's own buffers
            load = potluck.Optimizer._try_load_state

            async def measured_load(self, timeout: float) -> bool:
                done = await load(self, timeout)
                download_peaks.append(peak_mb())
                return done
            potluck.Optimizer._try_load_state = measured_load
        peer = potluck.Peer(host="127.0.0.1", initial_peers=[args.initial] if args.initial else [])
        options = dict(target_batch_size=1, batch_size_per_step=1, matchmaking_time=MATCHMAKING_TIME,
                       load_state=args.worker == "newcomer")
        if args.worker == "diloco":
            options.update(mode="diloco", local_steps=DILOCO_LOCAL_STEPS)
        opt = potluck.Optimizer(peer, "memory", model.parameters(), make_adam, **options)
        closers = [opt.shutdown, peer.shutdown]
        if args.worker == "donor":
            say(event="ready", address=peer.addresses[0])
            read_line(WORKER_IDLE_TIMEOUT)  # serves its state until the parent says stop
    times: list[tuple[float, bool]] = []  # (seconds, whether the step closed an epoch or outer round)
    if args.worker in ("adam", "sync", "diloco"):
        generator = torch.Generator().manual_seed(0)
        vocab = model.embed.num_embeddings
        for _ in range(args.steps):
            tokens = torch.randint(0, vocab, (1, SEQUENCE + 1), generator=generator)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[0, 1:]).backward()
            started, epoch = time.perf_counter(), getattr(opt, "local_epoch", 0)
            opt.step()
            times.append((time.perf_counter() - started, getattr(opt, "local_epoch", 0) != epoch))
            opt.zero_grad()
    say(event="final", peak_mb=peak_mb(), baseline_mb=baseline, model_mb=model_mb, step_s=times,
        params=sum(p.numel() for p in model.parameters()), download_peak_mb=(download_peaks or [None])[0],
        downloaded=abs(float(first.mean()) - before - DONOR_SHIFT) < DONOR_SHIFT / 2)
    for close in closers:
        close()


# == parent side ==================================================================================
def run_case(case: str, args: argparse.Namespace, env: dict) -> dict:
    base = [sys.executable, __file__, "--steps", str(args.steps), *(["--quick"] if args.quick else [])]
    workers: list[Worker] = []
    try:
        initial: list[str] = []
        if case == "newcomer":
            workers.append(Worker([*base, "--worker", "donor"], env))
            initial = ["--initial", workers[0].expect("ready", STARTUP_TIMEOUT)["address"]]
        workers.append(Worker([*base, "--worker", case, *initial], env))
        final = workers[-1].expect("final", STARTUP_TIMEOUT + CASE_TIMEOUT)
        if case == "newcomer":
            workers[0].send("stop")
        return final
    finally:
        for w in workers:
            w.kill()


def step_row(case: str, steps: list[list], adam: list[list], common: dict) -> dict:
    """opt.step()'s median time; diloco's inner and outer steps also apart (a lone peer's outer step
    includes MATCHMAKING_TIME spent waiting for partners)."""
    median = statistics.median(s for s, _ in steps)
    row = {"metric": "step_time", "value": round(median, 4), "unit": "s", "case": case,
           "max_s": round(max(s for s, _ in steps), 4), "measured": "opt.step() alone, median after the first",
           **common}
    if case == "diloco":
        for kind, outer in (("inner", False), ("outer", True)):
            row[f"{kind}_median_s"] = round(statistics.median([s for s, o in steps if o == outer] or [0.0]), 4)
    if case != "adam" and adam:
        row["step_overhead_ratio"] = round(median / statistics.median(s for s, _ in adam), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 10M-parameter model: under a minute")
    parser.add_argument("--steps", type=int, default=5, help="training steps per case (the first is warm-up)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--worker", choices=[*CASES, "donor"], help=argparse.SUPPRESS)
    parser.add_argument("--initial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.quick:
        args.steps = min(args.steps, 4)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    shape = QUICK if args.quick else FULL
    common = {"model": "GPT " + ", ".join(f"{k}={v}" for k, v in shape.items()), "sequence": SEQUENCE,
              "steps": args.steps, "torch_threads": 1, "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join(["python", "benchmarks/memory.py", *sys.argv[1:]])}
    results: dict[str, dict] = {}
    for case in args.cases.split(","):
        try:
            results[case] = got = run_case(case, args, env)
        except Exception as e:  # noqa: BLE001 - report and go on with the other cases
            emit({"metric": "peak_rss", "value": None, "unit": "MB", "case": case, **common,
                  "error": f"{type(e).__name__}: {e}"[-3000:]})
            continue
        model_mb = got["model_mb"]
        row = {"metric": "peak_rss", "value": round(got["peak_mb"]), "unit": "MB", "case": case,
               "model_mb": round(model_mb), "params": got["params"], "model_only_rss_mb": round(got["baseline_mb"]),
               **common}
        if "adam" in results and case != "adam":
            row["extra_over_adam_models"] = round((got["peak_mb"] - results["adam"]["peak_mb"]) / model_mb, 2)
        emit(row)
        if case.startswith("newcomer"):
            emit({"metric": "newcomer_peak", "value": round((got["peak_mb"] - got["baseline_mb"]) / model_mb, 2),
                  "unit": "model sizes", "case": case, "downloaded": got["downloaded"],
                  "measured": "peak RSS over RSS with the model alone", "model_mb": round(model_mb), **common})
        if got.get("download_peak_mb"):
            emit({"metric": "newcomer_download_peak",
                  "value": round((got["download_peak_mb"] - got["baseline_mb"]) / model_mb, 2), "unit": "model sizes",
                  "case": case, "measured": "peak RSS when the download ends (the model, the optimizer statistics "
                  "and the chunks in flight) over RSS with the model alone", "model_mb": round(model_mb), **common})
        if got["step_s"][1:]:
            emit(step_row(case, got["step_s"][1:], results.get("adam", {}).get("step_s", [])[1:], common))


if __name__ == "__main__":
    main()
