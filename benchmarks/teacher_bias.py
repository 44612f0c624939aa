"""Where LOPD's self-teacher disagrees with the student on the student's own replies (issue 33's format collapse).

    PYTHONPATH=<the runs' src> python benchmarks/teacher_bias.py \
        --run runs/experience/lopd/seed_0 --replies runs/experience/lopd/seed_0/generations/val_step_0.jsonl \
        --questions 48 --out benchmarks/results/teacher_bias_hidden_rules.json

On hidden_rules, LOPD's student learned to write the tool schema's ``"required": [...]`` list inside a call's
``arguments`` and lost the call format, where GRPO did not (benchmarks/README.md, "The experience
comparison"). LOPD's student loss is the top-M + tail reverse KL to the teacher on the student's own tokens
(docs/METHOD.md section 5, Eq. 10), so the student moves where the teacher puts more probability than it does.
This measures that, on the student's own greedy replies (one per held-out question, a generations file of
the run), teacher-forced, for each *state* and each teacher *context*:

States (``--states``):
  ``start``: the run's start student and the pretrained composer (``composer_path``) with the initial bank,
  the teacher of the run's first step; ``end``: everything of the run's checkpoint (student, composer, bank);
  ``end_composer``: the start student with the checkpoint's composer (the composer's own drift alone).

Contexts of the teacher (the same weights as the student: ``teacher_mode: live``):
  ``none``: nothing inserted, the alignment check (must equal the student: ``alignment_max_abs_logp``);
  ``latent``: the latents the training step inserts (the row's retrieved experiences, top-J, through the
  state's composer; the step's own key/value prefix path); ``latent_wrong``: the latents of another
  question's experiences (rows rolled by one); ``latent_noise``: Gaussian latents with each slot's norm;
  ``text_nearest``: the top-1 retrieved trajectory as text (OPSD's context on this task).

Per context, means over questions with a percentile bootstrap interval over questions:
  ``logp_delta``: mean over reply tokens of log p_T - log p_S (nats per token);
  ``reverse_kl``: the training loss's per-token top-M + tail KL(p_S || p_T) (M = the run's distill_top_k);
  at the token that closes the call's ``arguments`` (``}}`` after the last value), ``close_logp_delta``
  (log p_T - log p_S of that token) and ``comma_mass_delta`` (p_T - p_S of the tokens that go on with
  another key: their text, after any leading quote, starts with a comma), with ``close_reverse_kl``;
  ``required_logratio_delta``: the same reply with ``, "required": [<the schema's list>]`` added inside
  ``arguments`` against the clean reply, (log p_T(corrupt) - log p_T(clean)) - (log p_S(corrupt) -
  log p_S(clean)) in nats per reply: > 0 means the teacher prefers the schema-copying reply more than the
  student does, which the student loss moves the student towards.

The ``src`` measured is the one Python imports (``PYTHONPATH``): its hash is recorded as ``src_hash``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

CONTEXTS = ("none", "latent", "latent_wrong", "latent_noise", "text_nearest")
STATES = ("start", "end", "end_composer")


# ---------------------------------------------------------------------------------------- replies
def read_replies(path: Path, n: int | None) -> list[dict[str, Any]]:
    """The first ``n`` single-turn replies of a generations file whose call closes its ``arguments``
    (``}}`` follows the last value): {"example_id", "messages" (system, user, assistant), "reward"}."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        messages = row["messages"]
        if [m["role"] for m in messages] != ["system", "user", "assistant"] or "}}" not in messages[-1]["content"]:
            continue
        if corrupt_reply(messages[-1]["content"], ["x"]) is None:
            continue
        rows.append({"example_id": row["example_id"], "messages": messages, "reward": float(row["reward"])})
        if n is not None and len(rows) == n:
            break
    return rows


def corrupt_reply(reply: str, required: list[str]) -> str | None:
    """``reply`` with ``, "required": [...]`` added as the last key of the first call's ``arguments``
    (before the ``}}`` that closes them), or None when the reply has no such place."""
    at = reply.find("}}")
    if at < 0 or '"arguments": {' not in reply[:at]:
        return None
    return reply[:at] + ', "required": ' + json.dumps(required) + reply[at:]


def schema_required(system_prompt: str, reply: str) -> list[str]:
    """The ``required`` list of the called tool's schema in the system prompt (``[]`` when not found)."""
    try:
        name = json.loads(reply.split("<tool_call>")[1].split("</tool_call>")[0])[0]["name"]
        tools = json.loads(system_prompt.split("<tools>")[1].split("</tools>")[0])
    except (IndexError, KeyError, TypeError, ValueError):
        return []
    for tool in tools:
        if tool.get("name") == name:
            return list(tool.get("parameters", {}).get("required", []))
    return []


# ---------------------------------------------------------------------------------------- the module
def build_state(run: Path, state: str, checkpoint: Path):
    """The LOPD module of ``state`` (see the module docstring), in eval mode, HF backend."""
    import torch

    from lopd_lightning.modules import LOPDModule

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    hparams["generation_backend"] = "hf"
    module = LOPDModule(**hparams)
    if state in ("end", "end_composer"):
        saved = ckpt["state_dict"]
        if state == "end_composer":
            saved = {k: v for k, v in saved.items() if k.startswith("composer.") or ".composer." in k}
        missing, unexpected = module.load_state_dict(saved, strict=state == "end")
        if unexpected:
            raise ValueError(f"{checkpoint}: keys this module does not have: {unexpected[:3]}")
        if state == "end":
            module.load_method_state(ckpt["lopd_state"])
    module.eval()
    return module, int(ckpt.get("global_step", -1))


def make_batch(module, task, rows: list[dict[str, Any]], corrupt: bool):
    from lopd_lightning.rollout import batch_from_conversations

    examples = [task_example(task, row["example_id"]) for row in rows]
    conversations = []
    for row in rows:
        system, user, reply = (m["content"] for m in row["messages"])
        if corrupt:
            reply = corrupt_reply(reply, schema_required(system, reply))
        conversations.append([row["messages"][0], row["messages"][1], {"role": "assistant", "content": reply}])
    batch = batch_from_conversations(
        module.tokenizer, conversations, rewards=[row["reward"] for row in rows], group_ids=list(range(len(rows))),
        example_ids=[ex.id for ex in examples], tools=[task.tools(ex) for ex in examples],
    )
    module.annotate(batch, examples)
    batch.experiences = module.retrieve(task, examples)
    return batch


_EXAMPLES: dict[str, Any] = {}


def task_example(task, example_id: str):
    if not _EXAMPLES:
        for split in ("train", "val"):
            _EXAMPLES.update({ex.id: ex for ex in task.examples(split)})
    return _EXAMPLES[example_id]


def teacher_kwargs(module, batch, context: str, seed: int) -> dict[str, Any]:
    import torch

    if context == "none":
        return {}
    if context == "text_nearest":
        return {"context_ids": module.teacher.encode_text_context([e[0].trace if e else None for e in batch.experiences])}
    if context == "latent_wrong":
        rolled = batch.experiences[1:] + batch.experiences[:1]
        original, batch.experiences = batch.experiences, rolled
        try:
            composed = module.batch_latents(batch)
        finally:
            batch.experiences = original
        return {"latents": composed.latents, "latent_mask": composed.latent_mask}
    composed = module.batch_latents(batch)
    latents = composed.latents
    if context == "latent_noise":
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(latents.shape, generator=g, dtype=latents.dtype)
        latents = noise / noise.norm(dim=-1, keepdim=True) * latents.norm(dim=-1, keepdim=True)
    return {"latents": latents, "latent_mask": composed.latent_mask}


def close_index(tokens: list[str]) -> int | None:
    """The index, among a reply's tokens, of the first token holding the ``}`` that closes ``arguments``."""
    text = ""
    for i, piece in enumerate(tokens):
        if "}" in piece and '"arguments"' in text:
            return i
        text += piece
    return None


def score_batch(module, batch, corrupt_batch, contexts: tuple[str, ...], *, seed: int, comma_ids) -> dict[str, Any]:
    """Per row and context: the measures of the module docstring (lists over rows)."""
    import torch

    from lopd_lightning.lm import unpack
    from lopd_lightning.losses import token_logps
    from lopd_lightning.teacher import prefix_length

    top_k = int(module.hparams.distill_top_k)
    out: dict[str, dict[str, list[float]]] = {c: {} for c in contexts}
    seq_logp: dict[str, dict[str, Tensor]] = {}  # {which: {context or "student": (B,) sums}}
    with torch.no_grad():
        for which, b in (("clean", batch), ("corrupt", corrupt_batch)):
            targets, mask = module.shifted(b)
            n_prefix = prefix_length(b.attention_mask, b.context_position)
            student_fwd = module.student_forward(b, mask, keep_cache=True)
            from lopd_lightning.teacher.prefix_cache import TeacherPrefix

            prefix = TeacherPrefix.from_cache(student_fwd.cache, n_prefix)
            s_logits = student_fwd.values  # (N, V)
            tok = targets[mask]
            s_lp = token_logps(s_logits[None], tok[None])[0]
            seq_logp.setdefault(which, {})["student"] = (unpack(s_lp, mask) * mask).sum(dim=1)
            for context in contexts:
                kwargs = teacher_kwargs(module, b, context, seed)
                t_logits = module.teacher.on_student_positions(
                    b.input_ids, b.attention_mask, b.context_position, positions=module.unshift(mask), prefix=prefix,
                    **kwargs,
                )
                t_lp = token_logps(t_logits[None], tok[None])[0]
                seq_logp[which][context] = (unpack(t_lp, mask) * mask).sum(dim=1)
                if which != "clean":
                    continue
                if context == "none":
                    out[context]["alignment_max_abs_logp"] = [float((t_lp - s_lp).abs().max())]
                rkl = module.lm_head.reverse_kl(s_logits, t_logits, top_k=top_k, temperature=1.0)  # (N,)
                delta = unpack(t_lp - s_lp, mask)
                counts = mask.sum(dim=1).clamp_min(1)
                rows = out[context]
                rows.setdefault("logp_delta", []).extend(((delta * mask).sum(1) / counts).tolist())
                rows.setdefault("reverse_kl", []).extend(((unpack(rkl, mask) * mask).sum(1) / counts).tolist())
                # the closing token, per row
                offsets = torch.cumsum(mask.sum(dim=1), 0) - mask.sum(dim=1)
                p_s, p_t = s_logits.softmax(-1), t_logits.softmax(-1)
                for r in range(len(b)):
                    ids = tok[offsets[r] : offsets[r] + mask[r].sum()].tolist()
                    i = close_index([module.tokenizer.decode([t]) for t in ids])
                    if i is None:
                        continue
                    n = int(offsets[r]) + i
                    rows.setdefault("close_logp_delta", []).append(float(t_lp[n] - s_lp[n]))
                    rows.setdefault("comma_mass_delta", []).append(float(p_t[n, comma_ids].sum() - p_s[n, comma_ids].sum()))
                    rows.setdefault("comma_mass_student", []).append(float(p_s[n, comma_ids].sum()))
                    rows.setdefault("comma_mass_teacher", []).append(float(p_t[n, comma_ids].sum()))
                    rows.setdefault("close_reverse_kl", []).append(float(rkl[n]))
    for context in contexts:
        t = seq_logp["corrupt"][context] - seq_logp["clean"][context]
        s = seq_logp["corrupt"]["student"] - seq_logp["clean"]["student"]
        out[context]["required_logratio_delta"] = (t - s).tolist()
        out[context]["required_logratio_student"] = s.tolist()
    return out


def comma_token_ids(tokenizer):
    """Ids of the tokens whose text, after any leading quote or space, starts with a comma."""
    import torch

    vocab = range(len(tokenizer))
    return torch.tensor([i for i in vocab if tokenizer.decode([i]).lstrip(' "').startswith(",")])


def bootstrap(values: list[float], *, resamples: int, seed: int) -> dict[str, Any]:
    import numpy as np

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return {"mean": None, "ci": None, "n": 0}
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(x.mean()), "ci": [float(lo), float(hi)], "n": int(x.size),
            "positive_fraction": float((x > 0).mean())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="an LOPD run folder (checkpoints/last.ckpt)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default <run>/checkpoints/last.ckpt")
    parser.add_argument("--replies", type=Path, required=True, help="a generations file (val_step_<n>.jsonl)")
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--batch-questions", type=int, default=4)
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--contexts", default=",".join(CONTEXTS))
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "teacher_bias.json")
    args = parser.parse_args(argv)

    import lightning as L
    import torch

    import lopd_lightning
    from compare_runs import src_provenance
    from lopd_lightning.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = args.checkpoint or args.run / "checkpoints" / "last.ckpt"
    for path, what in ((checkpoint, "--checkpoint"), (args.replies, "--replies")):
        if not path.is_file():
            raise SystemExit(f"error: {what}: no file {path}")
    states = [s for s in args.states.split(",") if s]
    contexts = tuple(c for c in args.contexts.split(",") if c)
    for name, given, known in (("--states", states, STATES), ("--contexts", contexts, CONTEXTS)):
        if unknown := sorted(set(given) - set(known)):
            raise SystemExit(f"error: {name}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    config = json.loads(json.dumps(__import__("yaml").safe_load((args.run / "config.yaml").read_text())))
    data = config["data"]["init_args"]
    task = get_task(data["task"], **(data.get("task_options") or {}))
    rows = read_replies(args.replies, args.questions)
    result: dict[str, Any] = {
        **run_metadata(seed=args.seed, argv=argv),
        "src_hash": src_provenance(Path(lopd_lightning.__file__).resolve().parents[2])["src_hash"],
        "run": str(args.run), "checkpoint": str(checkpoint), "replies": str(args.replies),
        "questions": [r["example_id"] for r in rows], "states": {},
    }
    for state in states:
        L.seed_everything(args.seed)
        t0 = time.perf_counter()
        module, step = build_state(args.run, state, checkpoint)
        comma_ids = comma_token_ids(module.tokenizer)
        merged: dict[str, dict[str, list[float]]] = {c: {} for c in contexts}
        for i in range(0, len(rows), args.batch_questions):
            part = rows[i : i + args.batch_questions]
            scores = score_batch(module, make_batch(module, task, part, False), make_batch(module, task, part, True),
                                 contexts, seed=args.seed + i, comma_ids=comma_ids)
            for c in contexts:
                for key, values in scores[c].items():
                    merged[c].setdefault(key, []).extend(values)
            print(f"{state}: {min(i + args.batch_questions, len(rows))}/{len(rows)} questions "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        summary: dict[str, Any] = {"checkpoint_step": step if state != "start" else 0,
                                   "bank_size": len(module.bank), "seconds": time.perf_counter() - t0}
        for c in contexts:
            summary[c] = {key: (max(v) if key == "alignment_max_abs_logp" else
                                bootstrap(v, resamples=args.resamples, seed=args.seed))
                          for key, v in merged[c].items()}
        result["states"][state] = summary
        write_json_atomic(result, args.out)
        del module
    print(json.dumps({s: {c: {k: (v["mean"] if isinstance(v, dict) else v) for k, v in d.items()}
                          for c, d in result["states"][s].items() if isinstance(d, dict)}
                      for s in result["states"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
