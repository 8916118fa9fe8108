"""The GPU check's short human summary: one or two lines per section from the JSON report."""
from __future__ import annotations


def _g(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt) if isinstance(x, (int, float)) else str(x)


def gradients(r: dict) -> list[str]:
    worst = ", ".join(f"{k} {_g(v, '.1e')}" for k, v in r["max_rel_error_by_model"].items())
    return [f"max relative gradient error {_g(r['max_rel_error'], '.1e')} ({worst})",
            f"deterministic repeats bitwise equal: {r['deterministic_repeats_bitwise_equal']}; "
            f"failed cases: {r['failed_cases']}"] + \
        ([f"cuDNN refused eval-mode RNN backward (rows measured with cuDNN off): {', '.join(r['cudnn_refused'])}"]
         if r.get("cudnn_refused") else [])


def memory(r: dict) -> list[str]:
    lines = []
    for m in r["methods"]:
        mem = (f"allocated {_g(m.get('max_memory_allocated_mib'), '.0f')} MiB, reserved "
               f"{_g(m.get('max_memory_reserved_mib'), '.0f')} MiB") if "max_memory_reserved_mib" in m else \
            f"RSS peak +{_g(m.get('rss_peak_above_start_mib'), '.0f')} MiB"
        s = m["host_syncs"]
        syncs = (f"syncs/decoder step {_g(s['phase_one_per_decoder_step'])}, /chunk {_g(s['phase_two_per_chunk'])}"
                 if "phase_two_per_chunk" in s else f"syncs/decoder step {_g(s['search_per_decoder_step'])}")
        cuda = s.get("cuda", {})
        if "phase_two_per_chunk" in cuda:
            syncs += (f" (CUDA's count: {_g(cuda['phase_one_per_decoder_step'])}/decoder step, "
                      f"{_g(cuda['phase_two_per_chunk'])}/chunk)")
        elif "search_per_decoder_step" in cuda:
            syncs += f" (CUDA's count: {_g(cuda['search_per_decoder_step'])}/decoder step)"
        off = " (cuDNN off: it refused eval-mode RNN backward)" if m.get("cudnn") == "off" else ""
        lines.append(f"{m['method']}{off}: {mem}, step {_g(m['step_s'])} s, {syncs}")
    lines += [f"{k}: {v}" for k, v in r["errors"].items()]
    if "ratios_one_over_two" in r:
        q = r["ratios_one_over_two"]
        lines.append(f"one-phase / two-phase: memory {_g(q['memory'])}x, step time {_g(q['step_time'])}x")
    return lines


def oom(r: dict) -> list[str]:
    return [f"budget chunk {r['budget_chunk']} of {r['rows']} rows; asked {r['asked_chunk']}, tried "
            f"{r['chunk_sizes_tried']} ({r['out_of_memory_errors']} OOM{', simulated' if r['simulated'] else ''}); "
            f"gradient vs budget chunks {_g(r['rel_error_vs_budget_chunks'], '.1e')}"]


def mixed(r: dict) -> list[str]:
    lines = []
    for mode in ("float32", "bf16", "fp16"):
        m = r.get(mode, {})
        if "skipped" in m or "error" in m:
            lines.append(f"{mode}: {m.get('skipped') or m.get('error')}")
        elif m:
            lines.append(f"{mode}: loss finite {m['loss_finite']}, grads finite {m['gradients_finite']}, grad vs "
                         f"fp32 {_g(m['grad_rel_diff_vs_float32'], '.1e')}, chunked vs whole "
                         f"{_g(m.get('chunked_vs_whole_rel_diff'), '.1e')}, |score - log p| max "
                         f"{_g(m['score_max_abs_diff_nats'], '.1e')} nats (phase two "
                         f"{_g(m['rescore_max_abs_diff_nats'], '.1e')})")
        seen = m.get("recurrent_dtypes")
        if seen:
            lines.append(f"    {mode} recurrent layers: " + "; ".join(
                f"{label} {seen[label].get('error') or seen[label]['operators'] or seen[label]['layers']}"
                for label in ("torch_autocast", "twophase")) + f"; twophase's in float32: {seen['rnns_in_float32']}")
    return lines


def generate(r: dict) -> list[str]:
    lines = []
    for x in r["results"]:
        if "error" in x:
            lines.append(f"{x['model']} {x['search']}: {x['error']}")
            continue
        parts = []
        for name in ("twophase", "generate"):
            m = x[name]
            parts.append(f"{name} {m['error']}" if "error" in m else
                         f"{name} {_g(m['step_ms'])} ms/step, {_g(m['host_syncs_per_step'])} syncs/step"
                         + (f" (CUDA's {_g(m['cuda_syncs_per_step'])})" if m.get("cuda_syncs_per_step") is not None
                            else ""))
        ratio = x.get("ratio_twophase_over_generate", {}).get("whole_s")
        lines.append(f"{x['model']} {x['search']}: " + "; ".join(parts) + f"; whole ratio {_g(ratio)}")
    return lines


def multi(r: dict) -> list[str]:
    return [", ".join(f"{k} {_g(v, '.1e') if isinstance(v, float) else v}" for k, v in r.items() if k != "flags")]


def karelrate(r: dict) -> list[str]:
    return [f"MLE {_g(r['mle']['steps_per_s'])} steps/s, RL {_g(r['rl']['steps_per_s'])} steps/s; the paper's "
            f"{r['paper_steps']['mle']} + {r['paper_steps']['rl']} steps: {_g(r.get('paper_schedule_hours'))} h"]


def largestbeam(r: dict) -> list[str]:
    lines = []
    for method, found in r["methods"].items():
        if "error" in found:
            lines.append(f"{method}: {found['error']}")
            continue
        at = found.get("at_k") or {}
        memory = at.get("max_memory_reserved_mib")
        lines.append(f"{method}: largest K {found['largest_k']} (first failing {found['first_failing_k']}, "
                     f"{found['stopped']}); at K {r['at_k']}: "
                     + (f"reserved {_g(memory, '.0f')} MiB, step {_g(at.get('step_s'))} s" if memory is not None
                        else f"fits {at.get('fits')}"))
    card = r["card"]
    lines.append("card: simulated on the CPU" if card.get("simulated") else
                 f"card: {card['card_gib']} GiB of {card['device_gib']} GiB (fraction {card['fraction']})")
    return lines


LINES = {"a": gradients, "b": memory, "c": oom, "d": mixed, "e": generate, "f": multi, "g": largestbeam,
         "h": karelrate}


def summary(report: dict) -> str:
    from .runner import SECTIONS
    out = []
    for letter, outcome in report["sections"].items():
        head = f"({letter}) {SECTIONS[letter][1]}: {outcome['status']} ({outcome['seconds']:.0f} s)"
        out.append(head)
        if outcome["status"] == "ok":
            try:
                out += [f"    {line}" for line in LINES[letter](outcome["result"])]
            except (KeyError, TypeError) as err:  # a result this summary cannot read: the JSON has it all
                out.append(f"    (see the JSON report; summary: {type(err).__name__} {err})")
        else:
            out.append(f"    {outcome.get('reason') or outcome.get('error')}")
    out.append(f"total {report['total_seconds']:.0f} s")
    return "\n".join(out)
