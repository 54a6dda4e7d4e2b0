"""The GPU side of `invoke tune`: `python -m vllmstack.tune.kernel_bench SPEC.json OUT.json`.

It runs where the engine runs (the engine's Python, with torch, Triton and vLLM) and calls vLLM's
own Triton kernels: fused_experts under override_config for MoE, _w8a8_triton_block_scaled_mm for
block-FP8 dense. For every batch size it

1. builds inputs at the real shape (random values: kernel speed does not depend on them) with
   weight scales that differ from group to group, so a tile that mixes scale groups gives wrong
   numbers instead of the same ones;
2. computes an fp32 reference from the dequantized operands, runs vLLM's stock config (its shipped
   file for this device, else its default) and checks the harness against it;
3. gates every candidate against that reference before timing it (verdict.passes_gate);
4. times with CUDA graphs (10 launches a replay) or, for long kernels, plain event loops;
5. re-times stock and the best candidate in turns, for the keep rule on the host.

Tiles are compiled first by worker processes (Triton's disk cache is shared), so the timing loop
does not wait on the compiler. The result is rewritten after every batch size: a run cut short
keeps what it measured. Only stdlib, torch, Triton and vLLM are imported (no vllmstack settings).
"""

from __future__ import annotations

import concurrent.futures as futures
import importlib
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from vllmstack.tune import space as sp
from vllmstack.tune import verdict as vd

GRAPH_LAUNCHES = 10  # launches captured in one CUDA graph (as vLLM's benchmark_moe.py does)
RERUN_ROUNDS = 3
PRECOMPILE_SHARE = 0.45  # at most this much of the budget goes to compiling tiles


def _mod(name: str) -> Any:
    return importlib.import_module(name)


def log(text: str) -> None:
    print(f"[tune {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Inputs, references and launches


class MoeProblem:
    """One MoE shape's weights (shared by every batch size) and its fp32 dequantized copies."""

    def __init__(self, shape: dict[str, Any], seed: int, reference: bool = True) -> None:
        torch = _mod("torch")
        self.torch = torch
        self.E, self.N, self.K, self.topk = shape["E"], shape["N"], shape["K"], shape["topk"]
        self.fp8 = shape.get("dtype") == "fp8_w8a8"
        self.block = shape.get("block_shape")
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev, e, n, k = "cuda", self.E, self.N, self.K
        if self.fp8:
            f8 = torch.float8_e4m3fn
            self.w1 = (torch.randn(e, 2 * n, k, device=dev, generator=g) * 0.5).to(f8)
            self.w2 = (torch.randn(e, k, n, device=dev, generator=g) * 0.5).to(f8)
            bn, bk = self.block or (2 * n, k)
            # Scales vary 4x between groups: a tile reading its neighbour's scale is visibly wrong.
            self.w1_scale = (torch.rand(e, -(-2 * n // bn), -(-k // bk), device=dev, generator=g)
                             * 0.015 + 0.005)
            self.w2_scale = (torch.rand(e, -(-k // bn), -(-n // bk), device=dev, generator=g)
                             * 0.015 + 0.005)
            if reference:  # 3 GiB of fp32 copies: the compile workers go without
                self.w1f = self.w1.float() * _expand(torch, self.w1_scale, bn, bk, 2 * n, k)
                self.w2f = self.w2.float() * _expand(torch, self.w2_scale, bn, bk, k, n)
            cfg_mod = _mod("vllm.model_executor.layers.fused_moe.config")
            self.quant = cfg_mod.fp8_w8a8_moe_quant_config(
                w1_scale=self.w1_scale, w2_scale=self.w2_scale, block_shape=list(self.block)
                if self.block else None)
        else:
            self.w1 = (torch.randn(e, 2 * n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            self.w2 = (torch.randn(e, k, n, device=dev, generator=g) * 0.02).to(torch.bfloat16)
            self.quant = None
            if reference:
                self.w1f, self.w2f = self.w1.float(), self.w2.float()
        self.gen = g

    def case(self, m: int) -> dict[str, Any]:
        torch = self.torch
        x = torch.randn(m, self.K, device="cuda", dtype=torch.bfloat16, generator=self.gen)
        ids = torch.rand(m, self.E, device="cuda", generator=self.gen).topk(self.topk, dim=1).indices
        weights = torch.softmax(torch.randn(m, self.topk, device="cuda", generator=self.gen), dim=1)
        return {"x": x, "ids": ids.to(torch.int32), "weights": weights.float(), "m": m}

    def reference(self, case: dict[str, Any]) -> Any:
        """sum over the token's experts of weight * W2 @ (silu(gate) * up), all in fp32."""
        torch = self.torch
        x, ids, wts = case["x"].float(), case["ids"].long(), case["weights"]
        out = torch.zeros(x.shape[0], self.K, device="cuda", dtype=torch.float32)
        flat = ids.flatten()
        order = torch.argsort(flat)
        tokens = torch.arange(x.shape[0], device="cuda").repeat_interleave(self.topk)[order]
        weights = wts.flatten()[order]
        counts = torch.bincount(flat, minlength=self.E).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count:
                t = tokens[start:start + count]
                h = x[t] @ self.w1f[e].T
                act = torch.nn.functional.silu(h[:, :self.N]) * h[:, self.N:]
                out.index_add_(0, t, (act @ self.w2f[e].T) * weights[start:start + count, None])
                start += count
        return out

    def runner(self, case: dict[str, Any], config: dict[str, Any]) -> Any:
        fused = _mod("vllm.model_executor.layers.fused_moe.fused_moe")
        override = _mod("vllm.model_executor.layers.fused_moe").override_config

        def run() -> Any:
            with override(dict(config)):
                return fused.fused_experts(case["x"], self.w1, self.w2, case["weights"], case["ids"],
                                           quant_config=self.quant)
        return run

    def stock(self, m: int) -> tuple[dict[str, Any], str, dict[int, Any] | None]:
        """What vLLM uses at batch size m: its shipped file's nearest entry, else its default."""
        fused = _mod("vllm.model_executor.layers.fused_moe.fused_moe")
        dtype = "fp8_w8a8" if self.fp8 else None
        bn, bk = self.block or (0, 0)
        shipped = fused.get_moe_configs(self.E, self.N, dtype, bn or None, bk or None)
        if shipped:
            key = min(shipped, key=lambda k: abs(k - m))
            return dict(shipped[key]), "shipped", shipped
        default = fused.get_default_config(m, self.E, self.N, self.K, self.topk, dtype,
                                           list(self.block) if self.block else None)
        return dict(default), "default", None

    def file_name(self) -> str:
        fused = _mod("vllm.model_executor.layers.fused_moe.fused_moe")
        return str(fused.get_config_file_name(self.E, self.N, "fp8_w8a8" if self.fp8 else None,
                                              list(self.block) if self.block else None))

    def rows(self, m: int) -> int:
        return sp.moe_rows(m, self.topk, self.E)


class DenseProblem:
    """One block-FP8 GEMM shape: C[M,N] = A[M,K] @ B[N,K]^T with per-token-group A scales."""

    def __init__(self, shape: dict[str, Any], seed: int, reference: bool = True) -> None:
        torch = _mod("torch")
        self.torch = torch
        self.N, self.K = shape["N"], shape["K"]
        self.bn, self.bk = shape["block_shape"]
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.B = (torch.randn(self.N, self.K, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
        self.Bs = (torch.rand(-(-self.N // self.bn), -(-self.K // self.bk), device="cuda", generator=g)
                   * 0.015 + 0.005)
        if reference:
            self.Bf = self.B.float() * _expand(torch, self.Bs, self.bn, self.bk, self.N, self.K)
        self.gen = g
        self.fp8_utils = _mod("vllm.model_executor.layers.quantization.utils.fp8_utils")

    def case(self, m: int) -> dict[str, Any]:
        torch = self.torch
        a = torch.randn(m, self.K, device="cuda", dtype=torch.bfloat16, generator=self.gen)
        aq, a_scale = self.fp8_utils.per_token_group_quant_fp8(a, self.bk, use_ue8m0=False)
        return {"aq": aq, "as": a_scale, "m": m}

    def reference(self, case: dict[str, Any]) -> Any:
        af = case["aq"].float() * case["as"].float().repeat_interleave(self.bk, dim=1)[:, :self.K]
        return af @ self.Bf.T

    def runner(self, case: dict[str, Any], config: dict[str, Any]) -> Any:
        torch, triton = self.torch, _mod("triton")
        kernel = self.fp8_utils._w8a8_triton_block_scaled_mm
        aq, a_scale, m = case["aq"], case["as"], case["m"]
        out = torch.empty(m, self.N, device="cuda", dtype=torch.bfloat16)
        tile = {k: int(config[k]) for k in sp.KEYS}
        grid = (triton.cdiv(m, tile["BLOCK_SIZE_M"]) * triton.cdiv(self.N, tile["BLOCK_SIZE_N"]),)

        def run() -> Any:
            # The same launch as fp8_utils.w8a8_triton_block_scaled_mm, with our tile.
            kernel[grid](aq, self.B, out, a_scale, self.Bs, m, self.N, self.K, self.bn, self.bk,
                         aq.stride(-2), aq.stride(-1), self.B.stride(1), self.B.stride(0),
                         out.stride(-2), out.stride(-1), a_scale.stride(-2), a_scale.stride(-1),
                         self.Bs.stride(1), self.Bs.stride(0), **tile)
            return out
        return run

    def stock(self, m: int) -> tuple[dict[str, Any], str, dict[int, Any] | None]:
        shipped = self.fp8_utils.get_w8a8_block_fp8_configs(self.N, self.K, self.bn, self.bk)
        if shipped:
            key = min(shipped, key=lambda k: abs(k - m))
            return dict(shipped[key]), "shipped", shipped
        # fp8_utils.w8a8_triton_block_scaled_mm's default when no file matches.
        return ({"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": self.bn, "BLOCK_SIZE_K": self.bk,
                 "GROUP_SIZE_M": 32, "num_warps": 4, "num_stages": 2}, "default", None)

    def file_name(self) -> str:
        device = _mod("vllm.utils.platform_utils").get_device_name_as_file_name()
        return (f"N={self.N},K={self.K},device_name={device},dtype=fp8_w8a8,"
                f"block_shape=[{self.bn},{self.bk}].json")

    def rows(self, m: int) -> int:
        return m


def _expand(torch: Any, scale: Any, bn: int, bk: int, rows: int, cols: int) -> Any:
    """Block scales [.., R/bn, C/bk] spread to every element [.., R, C]."""
    return scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :rows, :cols]


def make_problem(kind: str, shape: dict[str, Any], seed: int,
                 reference: bool = True) -> MoeProblem | DenseProblem:
    if kind == "moe":
        return MoeProblem(shape, seed, reference)
    return DenseProblem(shape, seed, reference)


def error_of(torch: Any, out: Any, ref: Any) -> float:
    diff = (out.float() - ref).norm().item()
    return vd.relative_error(diff, ref.norm().item())


def time_us(torch: Any, fn: Any) -> float:
    """Median microseconds of one launch, replayed from a CUDA graph of GRAPH_LAUNCHES launches.

    Always a graph: vLLM's fused_experts spends ~0.5 ms of Python per call, so timing eager calls
    measures the CPU, not the kernel (a first H200 run did, and called a 29 us kernel 400 us).
    Long kernels get fewer replays. A launch that cannot be captured is timed eagerly, in a burst
    of launches between two events, so the CPU runs ahead of the GPU."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[float] = []
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_LAUNCHES):
                fn()
    except Exception:
        graph = None
    if graph is not None:
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        first = start.elapsed_time(end) * 1000 / GRAPH_LAUNCHES
        for _ in range(max(3, min(10, int(20_000 / max(first * GRAPH_LAUNCHES, 1.0))))):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000 / GRAPH_LAUNCHES)
        graph.reset()
    else:
        for _ in range(5):
            start.record()
            for _ in range(GRAPH_LAUNCHES):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000 / GRAPH_LAUNCHES)
    return float(statistics.median(samples))


# --------------------------------------------------------------------------------------------
# Compiling tiles in worker processes


def spec_class(kind: str, m: int, topk: int) -> int:
    """The batch size that stands for m's Triton specialisation: Triton compiles an integer
    argument separately when it is 1 and when it is a multiple of 16, so one launch at 1, 2 and
    16 (MoE: routed rows M*topk) builds what every batch size will run."""
    rows = m * topk if kind == "moe" else m
    if rows == 1:
        return 1
    return 16 if rows % 16 == 0 else 2


def compile_jobs(kind: str, entries: list[dict[str, Any]], sizes: list[int]) -> list[list[Any]]:
    """[tile, representative size] for every tile some batch size of some shape may time, once per
    specialisation it will meet (the shapes' N and K are multiples of 16: they share kernels)."""
    jobs: dict[tuple[Any, ...], list[Any]] = {}
    for entry in entries:
        topk = int(entry["shape"].get("topk") or 1)
        for m in sizes:
            rep = spec_class(kind, m, topk)
            for config in entry["space"][str(m)]:
                jobs.setdefault((*(config[k] for k in sp.KEYS), rep), [config, rep])
    return list(jobs.values())


def _warm_worker(kind: str, shape: dict[str, Any], jobs: list[list[Any]], seed: int,
                 deadline: float) -> list[list[Any]]:
    """Launch each tile once at its representative size (Triton builds it and caches it on disk);
    return the tiles that fail to build or launch, with the error."""
    failed: list[list[Any]] = []
    problem = make_problem(kind, shape, seed, reference=False)
    cases: dict[int, dict[str, Any]] = {}
    for config, rep in jobs:
        if time.time() > deadline:
            break
        case = cases.setdefault(rep, problem.case(rep))
        try:
            problem.runner(case, config)()
        except Exception as exc:
            failed.append([config, f"{type(exc).__name__}: {str(exc)[:200]}"])
    problem.torch.cuda.synchronize()
    return failed


def precompile(kind: str, shape: dict[str, Any], jobs: list[list[Any]], seed: int, seconds: float,
               workers: int) -> tuple[int, list[list[Any]]]:
    """Build the tiles in parallel; (workers used, failures). Stops at the deadline."""
    if workers <= 1 or len(jobs) < 8:
        return 0, []
    deadline = time.time() + seconds
    chunks = [jobs[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    failed: list[list[Any]] = []
    with futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        running = [pool.submit(_warm_worker, kind, shape, chunk, seed, deadline) for chunk in chunks]
        try:
            for job in futures.as_completed(running, timeout=seconds + 120):
                try:
                    failed += job.result()
                except Exception as exc:  # a worker that died leaves its tiles to the main process
                    log(f"compile worker failed: {type(exc).__name__}: {exc}")
        except futures.TimeoutError:
            log("compile workers outlived their time: the rest compiles as it is timed")
    return workers, failed


# --------------------------------------------------------------------------------------------
# Tuning one batch size


def tune_size(problem: MoeProblem | DenseProblem, m: int, space: list[dict[str, int]], seed: int,
              deadline: float, known_bad: set[tuple[int, ...]]) -> dict[str, Any]:
    torch = problem.torch
    stock, source, _ = problem.stock(m)
    row: dict[str, Any] = {"m": m, "stock": stock, "stock_source": source,
                           "stock_tile": sp.tile_of(stock), "space": len(space), "tried": 0,
                           "rejected": 0, "failed": 0, "rejected_examples": [], "budget_cut": False}
    case = problem.case(m)
    ref = problem.reference(case)
    stock_run = problem.runner(case, stock)
    stock_error = error_of(torch, stock_run(), ref)
    row["stock_error"] = stock_error
    if not vd.stock_is_sane(stock_error):
        row["error"] = (f"vLLM's own config is off by {stock_error:.3g} against the fp32 reference: "
                        "the harness is wrong, nothing was timed")
        return row
    best, best_us, best_error = sp.tile_of(stock), time_us(torch, stock_run), stock_error
    row["first_stock_us"] = best_us
    # One time_us is up to ~130 launches; the re-run does 2 x RERUN_ROUNDS of them.
    rerun_reserve = max(0.5, 2 * RERUN_ROUNDS * 130 * best_us / 1e6)
    for config in sp.ordered(space, stock, seed)[1:]:
        if time.time() > deadline - rerun_reserve:
            row["budget_cut"] = True
            break
        row["tried"] += 1
        if tuple(config[k] for k in sp.KEYS) in known_bad:
            row["failed"] += 1
            continue
        try:
            run = problem.runner(case, config)
            error = error_of(torch, run(), ref)
        except Exception:
            row["failed"] += 1
            continue
        if not vd.passes_gate(error, stock_error):
            row["rejected"] += 1
            if len(row["rejected_examples"]) < 3:
                row["rejected_examples"].append({"config": config, "error": round(error, 4)})
            continue
        try:
            took = time_us(torch, run)
        except Exception:
            row["failed"] += 1
            continue
        if took < best_us:
            best, best_us, best_error = dict(config), took, error
    row.update(best=best, best_error=best_error, first_best_us=best_us,
               gate_limit=vd.gate_limit(stock_error))
    best_run = problem.runner(case, best)
    stock_times, best_times = [], []
    for _ in range(RERUN_ROUNDS):  # in turns, so drift in clocks or heat hits both alike
        stock_times.append(time_us(torch, stock_run))
        best_times.append(time_us(torch, best_run))
    row["rerun"] = {"stock_us": stock_times, "best_us": best_times}
    del ref, case
    torch.cuda.empty_cache()
    return row


def tune_shape(kind: str, entry: dict[str, Any], spec: dict[str, Any], budget: vd.Budget,
               shapes_left: int, write: Any, bad: set[tuple[int, ...]]) -> dict[str, Any]:
    shape = entry["shape"]
    out: dict[str, Any] = {"shape": shape, "batch_sizes": []}
    share_end = time.time() + budget.share(shapes_left)
    problem = make_problem(kind, shape, spec["seed"])
    out["vllm_file_name"] = problem.file_name()
    _, source, shipped = problem.stock(1)
    out["stock_source"] = source
    out["shipped"] = {str(k): v for k, v in shipped.items()} if shipped else None
    sizes = [int(m) for m in spec["batch_sizes"]]
    for index, m in enumerate(sizes):
        deadline = time.time() + (share_end - time.time()) / (len(sizes) - index)
        try:
            row = tune_size(problem, m, entry["space"][str(m)], spec["seed"] + m, deadline, bad)
        except Exception:
            row = {"m": m, "error": traceback.format_exc()[-2000:]}
        out["batch_sizes"].append(row)
        log(f"{out['vllm_file_name']} M={m}: stock {row.get('first_stock_us', float('nan')):.1f}us "
            f"-> best {row.get('first_best_us', float('nan')):.1f}us, tried {row.get('tried')}/"
            f"{row.get('space')}, gate rejected {row.get('rejected')}, failed {row.get('failed')}")
        write(out)
    del problem
    _mod("torch").cuda.empty_cache()
    return out


def versions() -> dict[str, str]:
    got = {}
    for name in ("vllm", "triton", "torch"):
        try:
            got[name] = str(_mod(name).__version__)
        except Exception as exc:
            got[name] = f"unavailable ({type(exc).__name__})"
    return got


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    torch = _mod("torch")
    # The reference must be fp32, not TF32 (10-bit mantissa: as coarse as what it checks).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    platform_utils = _mod("vllm.utils.platform_utils")
    result: dict[str, Any] = {
        "kind": spec["kind"], "versions": versions(), "device": torch.cuda.get_device_name(0),
        "device_file_name": platform_utils.get_device_name_as_file_name(),
        "budget_s": spec["budget_s"], "shapes": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    budget = vd.Budget(float(spec["budget_s"]))

    def write(current: dict[str, Any] | None = None) -> None:
        shapes = [*result["shapes"], current] if current is not None else result["shapes"]
        data = {**result, "shapes": shapes, "elapsed_s": round(budget.used(), 1)}
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, out_path)

    sizes = [int(m) for m in spec["batch_sizes"]]
    jobs = compile_jobs(spec["kind"], spec["shapes"], sizes)
    started = time.time()
    used, failures = precompile(spec["kind"], spec["shapes"][0]["shape"], jobs, spec["seed"],
                                PRECOMPILE_SHARE * budget.left(), int(spec.get("workers") or 0))
    result["precompile"] = {"jobs": len(jobs), "workers": used, "seconds": round(time.time() - started, 1),
                            "failed": len(failures), "failed_examples": failures[:3]}
    log(f"compiled {len(jobs)} tile/specialisation pairs with {used} workers in "
        f"{time.time() - started:.0f}s ({len(failures)} failed)")
    bad = {tuple(c[k] for k in sp.KEYS) for c, _ in failures}
    for index, entry in enumerate(spec["shapes"]):
        try:
            done = tune_shape(spec["kind"], entry, spec, budget, len(spec["shapes"]) - index, write, bad)
        except Exception:
            done = {"shape": entry["shape"], "error": traceback.format_exc()[-3000:]}
            log(done["error"])
        result["shapes"].append(done)
        write()
    log(f"done in {budget.used():.0f}s of {spec['budget_s']}s")
    return 0 if all("error" not in s for s in result["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
