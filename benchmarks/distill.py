"""On-policy distillation, one step's gradient: TRL 1.16's `DistillationTrainer.compute_loss` beside twophase's
`rescore_backward(student, source, samples, distillation(teacher, beta, temperature), chunk_size)` on one causal
student-teacher pair (random Llamas, the teacher twice as wide), over the same completions the student sampled.

    python benchmarks/distill.py                 # the pair side by side, then twophase's memory sweeps
    python benchmarks/distill.py --vocab 8000 --repeats 5 --json out.json

For each method: the step's CPU time (process time of loss + backward, the median of --repeats after one warm-up
step) and its peak tensor memory (`twophase.system.memory.AllocationPeak`: the CPU bytes tensors hold above those
held when the step began, measured on a separate, untimed step), and the gradients' largest difference from
TRL's. Then twophase's peak against the vocabulary and the chunk size (rows per chunk), broken down by what
holds it at that moment (`breakdown`: one more step under the profiler, its Python stacks naming the function
each live tensor was made in): the parameters' gradients, other tensors of a V-sized parameter's size, the
output layer's logit blocks (with the divergence's), the prompts' forward (its graph and their last states),
the teacher's states, the rest (the chunk's graph). "peak - parameter-sized" is the peak less the first two:
what the step holds beyond what any gradient step of these parameters holds.

Letters: B prompts, K completions per prompt, N = B K rows, P prompt length, T completion length, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's twophase, run from anywhere

import torch  # noqa: E402

from twophase import protocol, rescore_backward, sample  # noqa: E402
from twophase.models.hf import HFCausalLM  # noqa: E402
from twophase.objectives import distillation  # noqa: E402

from .stepcost import measure  # noqa: E402

PAD, EOS, BOS = 0, 1, 2


def llama(vocab: int, width: int, layers: int, seed: int):
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return T.LlamaForCausalLM(config).eval()


def prompts(B: int, P: int, vocab: int, seed: int) -> dict:
    """B left-padded prompts of unequal length (P/2 to P), as TRL pads them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(P // 2, P + 1, (B,), generator=g)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    at = torch.arange(P)[None, :]
    mask = (at >= P - lengths[:, None]).long()
    return {"input_ids": torch.where(mask.bool(), ids, torch.full_like(ids, PAD)), "attention_mask": mask}


def trl_trainer(student, teacher, vocab: int, rows: int, T: int, beta: float, temperature: float):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import DistillationConfig, DistillationTrainer

    words = {"<pad>": PAD, "</s>": EOS, "<s>": BOS, **{f"w{i}": i for i in range(3, vocab)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="</s>", bos_token="<s>", padding_side="left")
    args = DistillationConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows,
                              max_completion_length=T, beta=beta, temperature=temperature, report_to="none",
                              use_cpu=True, bf16=False)
    return DistillationTrainer(model=student, teacher_model=teacher, args=args,
                               train_dataset=Dataset.from_dict({"prompt": ["w3"]}), processing_class=tokenizer)


def trl_step(trainer, source: dict, s, mask) -> None:
    inputs = {"prompt_ids": source["input_ids"][s.owner], "prompt_mask": source["attention_mask"][s.owner],
              "completion_ids": s.tokens, "completion_mask": mask.long(), "num_items_in_batch": mask.sum()}
    trainer.compute_loss(trainer.model, inputs).backward()


KINDS = ("gradients", "gradient-sized", "logit blocks", "prompts", "teacher states", "graph and rest")


def _kind(functions: tuple, size: int, gradient: bool, parameter_sizes: set) -> str:
    """Which of KINDS a tensor live at the peak is: a parameter's gradient; as large as a V-sized parameter
    (an embedding's dense gradient before it is added to .grad); else by the twophase functions it was made
    under (innermost last)."""
    if gradient:
        return "gradients"
    if size in parameter_sizes:
        return "gradient-sized"
    if "_prompt" in functions:  # the prompts' forward: its graph and their last states (B, H)
        return "prompts"
    if "decoded" in functions:
        return "teacher states"
    if "target_log_probs_and_grads" in functions:
        return "logit blocks"
    return "graph and rest"


def breakdown(step, model, vocab: int) -> dict:
    """The peak of one more untimed step's tensor bytes (above those held when it began) and the bytes of the
    tensors live at that moment by KINDS, in MiB, from the profiler's allocation record and Python stacks."""
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                with_stack=True) as prof:
        step()
    made = []  # (time, address, bytes (negative: a free), the twophase functions the allocation was made under)

    def walk(node, functions: tuple) -> None:
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == "cpu":
                made.append((node.start_time_ns, fields.ptr, fields.alloc_size, functions))
            return
        if type(fields).__name__ == "_ExtraFields_PyCall" and "twophase/" in node.name:
            functions = functions + (node.name.rsplit(": ", 1)[-1],)  # "twophase/x.py(12): f" -> "f"
        for child in node.children:
            walk(child, functions)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    made.sort(key=lambda event: event[0])  # stable: events of one nanosecond keep their order
    live: dict[int, int] = {}  # address -> index into made of the allocation there
    total = peak = 0
    at_peak: dict[int, int] = {}
    for i, (_, ptr, size, _) in enumerate(made):
        if size > 0:
            live[ptr] = i
        else:
            live.pop(ptr, None)
        total += size
        if total > peak:
            peak, at_peak = total, dict(live)
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    sizes = {p.numel() * p.element_size() for p in model.parameters() if p.shape[0] == vocab}  # (V, H)
    out = {kind: 0.0 for kind in KINDS}
    for ptr, i in at_peak.items():
        _, _, size, functions = made[i]
        gradient = ptr in grads and live.get(ptr) == i  # the same allocation still holds it when the step ends
        out[_kind(functions, size, gradient, sizes)] += size / 2**20
    model.zero_grad(set_to_none=True)
    return {"peak_mb": peak / 2**20, **out,
            "beyond_parameters_mb": (peak / 2**20) - out["gradients"] - out["gradient-sized"]}


def largest_difference(a: list, b: list) -> float:
    scale = max(float(x.abs().max()) for x in b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def pair(args, vocab: int, with_trl: bool, chunks: list[int], broken_down: bool = False) -> list[dict]:
    student = llama(vocab, args.width, args.layers, seed=0)
    teacher = llama(vocab, 2 * args.width, args.layers, seed=1)
    wrapper, teacher_wrapper = HFCausalLM(student), HFCausalLM(teacher)
    source = prompts(args.prompts, args.prompt_len, vocab, seed=2)
    s = sample(wrapper, source, args.samples, args.completion_len, generator=torch.Generator().manual_seed(3))
    mask = protocol.target_mask(s.tokens, wrapper.pad_id, wrapper.eos_id)
    common = {"vocab": vocab, "rows": len(s), "tokens": int(mask.sum())}
    out, trl = [], None
    if with_trl:
        trainer = trl_trainer(student, teacher, vocab, len(s), args.completion_len, args.beta, args.temperature)
        wrapper.eval()  # TRL's eval mode: no gradient-accumulation scaling (and no dropout, as phase two)
        trl = measure(lambda: trl_step(trainer, source, s, mask), wrapper, args.repeats, keep_grads=True)
        out.append({"method": "TRL DistillationTrainer.compute_loss", "chunk": len(s), **common,
                    "cpu_s": trl["cpu_s"], "peak_mb": trl["peak_mb"], "grad_diff": 0.0})
    objective = distillation(teacher_wrapper, args.beta, args.temperature)
    for chunk in chunks:
        ours = measure(lambda: rescore_backward(wrapper, source, s, objective, chunk_size=chunk), wrapper,
                       args.repeats, keep_grads=True)
        out.append({"method": "twophase rescore_backward", "chunk": chunk, **common, "cpu_s": ours["cpu_s"],
                    "peak_mb": ours["peak_mb"],
                    "grad_diff": largest_difference(ours["grads"], trl["grads"]) if trl else None})
        if broken_down:
            out[-1]["breakdown"] = breakdown(lambda: rescore_backward(wrapper, source, s, objective, chunk_size=chunk),
                                             wrapper, vocab)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| method | V | rows | chunk | step CPU s | peak tensor MiB | gradient vs TRL |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r["grad_diff"] is None else f"{r['grad_diff']:.1e}"
        lines.append(f"| {r['method']} | {r['vocab']} | {r['rows']} | {r['chunk']} | {r['cpu_s']:.3f} | "
                     f"{r['peak_mb']:.1f} | {diff} |")
    return "\n".join(lines)


def breakdown_table(rows: list[dict]) -> str:
    """twophase's rows: the peak and what held it (MiB)."""
    lines = ["| V | chunk | peak | " + " | ".join(KINDS) + " | peak - parameter-sized |",
             "|---" * (len(KINDS) + 4) + "|"]
    for r in rows:
        b = r.get("breakdown")
        if b is not None:
            lines.append(f"| {r['vocab']} | {r['chunk']} | {b['peak_mb']:.1f} | "
                         + " | ".join(f"{b[k]:.1f}" for k in KINDS) + f" | {b['beyond_parameters_mb']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=4000, help="V of the side-by-side pair")
    parser.add_argument("--sweep-vocab", default="1000,4000,16000", help="V values of the memory sweep")
    parser.add_argument("--chunks", default="1,4,16", help="twophase's chunk sizes (rows)")
    parser.add_argument("--sweep-chunks", default="4", help="twophase's chunk sizes in the vocabulary sweep")
    parser.add_argument("--width", type=int, default=64, help="the student's width (the teacher's is twice it)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="B")
    parser.add_argument("--samples", type=int, default=4, help="K completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=16, help="P")
    parser.add_argument("--completion-len", type=int, default=24, help="T")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write every row here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    side = pair(args, args.vocab, True, chunks)
    print(f"## The pair, V = {args.vocab}, beta {args.beta}, temperature {args.temperature}\n\n{table(side)}\n")
    sweep = []
    sweep_chunks = [int(c) for c in args.sweep_chunks.split(",")]
    for vocab in (int(v) for v in args.sweep_vocab.split(",")):
        sweep += pair(args, vocab, True, sweep_chunks, broken_down=True)
    print(f"## Peak against the vocabulary and the chunk\n\n{table(sweep)}\n")
    print(f"## What holds twophase's peak (MiB)\n\n{breakdown_table(sweep)}\n", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "pair": side, "vocab": sweep}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
