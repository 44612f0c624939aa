"""Do the latents carry the experience? The composer's capacity on facts that only the experience holds.

    python benchmarks/latent_capacity.py                               # -> benchmarks/results/latent_capacity.json
    python benchmarks/latent_capacity.py --paper --out benchmarks/results/latent_capacity_paper.json

The task is :class:`~lopd_lightning.tasks.facts.FactsTask`: 64 made-up facts ("The access code of project X
is S.", S five random lowercase letters), the first 48 for the composer's pretraining, the last 16 held out
(never in any training step). The bank holds every fact as its own experience (the held-out facts' are read
only at evaluation). The composer is pretrained by the stage LOPD uses (``lopd pretrain-composer``:
:func:`~lopd_lightning.composer.pretrain.pretrain_composer`, ``Trainer.fit``), with the LOPDModule's defaults
unless ``--paper`` (the paper's composer and warm start: the Perceiver resampler, L_init only, no
self-retrieval, output gain 1.0, ``warm_start_lr`` 1e-4: the quickstart's former composer rate, the paper's
being 1e-5) or the variant options say otherwise; K = 8 latents, J = 1 experience.

The teacher (the student's weights, ``teacher_mode: live``) is asked "What is the access code of project X?"
and scored on the reply's code, teacher-forced: the NLL summed over the reply's tokens before its
end-of-turn token (nats, mean over facts), with each context:

- ``none``: no context; ``text``: the fact as text, in the framing the latents use (``SelfTeacher``'s
  ``encode_text_context``, as ``privileged_margin.py`` frames ``text_nearest``); ``text_wrong``: another
  fact's text (the next fact of the same split, cyclically);
- ``latent``: the latents of the fact's own experience; ``latent_wrong``: those of the next fact's.

The same five, format-free (``sentence``): the reply teacher-forced is the fact's sentence, and only the
code's tokens after ``"The access code of project X is"`` are scored (:func:`code_nll`). The bare-code
score charges a teacher that answers in sentences (the text teacher) for the missing prefix, and a
composer pretrained on bare codes (L_init's reference) does not pay it; the sentence score has no such
format term.

Reported (keys of the JSON): ``heldout`` and ``train`` with the five NLLs; ``info_ratio_heldout`` =
(latent_wrong - latent) / (text_wrong - text), the share of the text's experience-specific information that
the latents carry; ``closing_ratio_heldout`` = (none - latent) / (none - text), the share of the text's whole
gain; ``spread`` and ``spread_untrained`` (:func:`~lopd_lightning.composer.losses.latent_spread` of the
held-out facts' latents, after and before pretraining: 0 is one constant prompt);
``teacher_contains_heldout`` (none / text / latent: the fraction of held-out facts whose code the teacher's
own greedy reply contains, within 32 tokens; ``teacher_replies_heldout``: those replies); ``sentence``: the
five NLLs on both splits and the two held-out ratios, format-free; ``curve``:
``info_ratio_heldout`` and ``closing_ratio_heldout`` every ``--curve-every`` steps; ``pretrain_steps``, ``pretrain_s`` (the stage's wall time), and the run's metadata
(``src_hash``, ``src_tree``: the code it ran).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402
from compare_runs import src_provenance  # noqa: E402

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: the paper's composer and warm start, as ``--paper`` sets them
PAPER = {"composer_architecture": "perceiver", "composer_output_gain": 1.0, "warm_start_reconstruction_weight": 0.0,
         "warm_start_self_retrieval": False, "warm_start_lr": 1e-4, "warm_start_reconstruction_noise": 0.0,
         "warm_start_lr_schedule": "constant"}


def build(args: argparse.Namespace):
    """(module, datamodule, task): an LOPDModule with K latents and J = 1, and a bank of every fact."""
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.modules import LOPDModule
    from lopd_lightning.tasks.facts import FactsTask

    task = FactsTask(num_examples=args.facts, num_heldout=args.heldout, seed=args.seed)
    options: dict[str, Any] = dict(num_latents=args.num_latents, num_experiences=1, embedder="hashing",
                                   warm_start_steps=args.steps, warm_start_batch_size=args.batch_size,
                                   max_experience_tokens=64, seed=args.seed, teacher_mode="live",
                                   latent_probe_every_n_steps=0)
    if args.paper:
        options.update(PAPER)
    for key, value in (("composer_architecture", args.architecture), ("warm_start_lr", args.lr),
                       ("warm_start_reconstruction_weight", args.reconstruction_weight),
                       ("warm_start_self_retrieval", args.self_retrieval),
                       ("warm_start_reconstruction_noise", args.reconstruction_noise),
                       ("warm_start_lr_schedule", args.lr_schedule)):
        if value is not None:
            options[key] = value
    student_options = {"lora": LORA} if args.student != "tiny" else {"lora": {"r": 4, "lora_alpha": 8,
                                                                               "target_modules": ["q_proj", "v_proj"]}}
    module = LOPDModule(args.student, **student_options, **options)
    records = []
    for example in task.examples("all"):
        messages, reward = module.reference_trajectory(task, example)
        records.append(module.experience_from_trajectory(task, example, messages, reward))
    module.bank.add(records)
    datamodule = OnPolicyDataModule(task, examples_per_step=args.batch_size, seed=args.seed)
    return module, datamodule, task


def record_of(module, example_id: str):
    return next(r for r in module.bank.records if r.task_id == example_id)


def answer_nll(module, batch, **context) -> list[float]:
    """Per row, the teacher's NLL summed over the reply's tokens before its end-of-turn token (nats)."""
    import torch

    from lopd_lightning.losses import token_logps

    targets, mask = module.shifted(batch)
    with torch.no_grad():
        logits = module.teacher.logits_on_student_positions(
            batch.input_ids, batch.attention_mask, batch.context_position, positions=module.unshift(mask), **context)
        logps = token_logps(logits[None], targets[mask][None])[0]
    out, start = [], 0
    for count in mask.sum(dim=1).tolist():
        out.append(-float(logps[start:start + count - 1].sum()))  # the last reply token ends the turn
        start += count
    return out


def sentence_batches(module, task, examples):
    """Two teacher-forced batches of the examples whose reply is the fact's sentence, with and without its
    code: ``"The access code of project X is wckyt"`` and ``"The access code of project X is"`` (the prompt
    as :meth:`reference_batch` builds it). The difference of their :func:`answer_nll` is the code's NLL
    after the sentence's own prefix: a score free of the reply's format (a teacher that answers with a
    sentence does not pay for the bare code's missing prefix).

    Raises:
        ValueError: the tokenizer splits the prefix differently once the code follows it.
    """
    from lopd_lightning.rollout import batch_from_conversations

    batches = []
    for with_code in (True, False):
        conversations = []
        for example in examples:
            conversation, _ = module.reference_trajectory(task, example)
            prefix = f"The access code of project {example.data['name']} is"
            reply = f"{prefix} {example.data['code']}" if with_code else prefix
            if with_code:
                ids = module.tokenizer(reply, add_special_tokens=False)["input_ids"]
                head = module.tokenizer(prefix, add_special_tokens=False)["input_ids"]
                if ids[: len(head)] != head:
                    raise ValueError(f"the tokenizer splits {prefix!r} differently before the code {example.data['code']!r}")
            last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
            conversations.append([*conversation[:last], {"role": "assistant", "content": reply}])
        batches.append(batch_from_conversations(module.tokenizer, conversations, rewards=[1.0] * len(examples),
                                                group_ids=list(range(len(examples))),
                                                example_ids=[ex.id for ex in examples]))
    return batches


def code_nll(module, sentence, **context) -> list[float]:
    """Per row, the NLL of the code's tokens after ``"The access code of project X is"`` (nats):
    :func:`answer_nll` of the sentence with the code minus that of the prefix alone (both teacher-forced)."""
    full, prefix = (answer_nll(module, batch, **context) for batch in sentence)
    return [a - b for a, b in zip(full, prefix, strict=True)]


def latents_for(module, examples, experiences):
    """The composer's latents for each example with the given experience (one per row)."""
    return module.composer.compose([[(ex.text, e.trace)] for ex, e in zip(examples, experiences, strict=True)])


def evaluate(module, task, examples, *, greedy: bool = False, text: dict | None = None) -> dict[str, Any]:
    """The five NLLs (mean over ``examples``), the latents' spread and, with ``greedy``, the contains-rates.
    ``text``: the text conditions already measured (they do not depend on the composer)."""
    import torch

    from lopd_lightning.composer import latent_spread

    batch = module.reference_batch(task, examples)
    own = [record_of(module, ex.id) for ex in examples]
    wrong = own[1:] + own[:1]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    sentence = sentence_batches(module, task, examples)
    result: dict[str, Any] = {k: dict(v) if isinstance(v, dict) else v for k, v in (text or {}).items()}
    if text is None:
        result["none"] = mean(answer_nll(module, batch))
        result["sentence"] = {"none": mean(code_nll(module, sentence))}
        for name, records in (("text", own), ("text_wrong", wrong)):
            ids = module.teacher.encode_text_context([r.trace for r in records])
            result[name] = mean(answer_nll(module, batch, context_ids=ids))
            result["sentence"][name] = mean(code_nll(module, sentence, context_ids=ids))
    with torch.no_grad():
        mine, other = latents_for(module, examples, own), latents_for(module, examples, wrong)
    for name, composed in (("latent", mine), ("latent_wrong", other)):
        context = {"latents": composed.latents, "latent_mask": composed.latent_mask}
        result[name] = mean(answer_nll(module, batch, **context))
        result["sentence"][name] = mean(code_nll(module, sentence, **context))
    result["spread"] = float(latent_spread(mine.latents))
    for scores, into in ((result, result), (result["sentence"], result["sentence"])):
        into["info_ratio"] = (scores["latent_wrong"] - scores["latent"]) / (scores["text_wrong"] - scores["text"])
        into["closing_ratio"] = (scores["none"] - scores["latent"]) / (scores["none"] - scores["text"])
    if greedy:
        from lopd_lightning.privilege import teacher_greedy_reply

        contains = {"none": 0, "text": 0, "latent": 0}
        result["replies"] = {"none": [], "text": [], "latent": []}
        with torch.no_grad():
            for i, (example, record) in enumerate(zip(examples, own, strict=True)):
                replies = {
                    "none": teacher_greedy_reply(module, task, example, max_new_tokens=32),
                    "text": teacher_greedy_reply(module, task, example, max_new_tokens=32,
                                                 context_ids=module.teacher.encode_text_context([record.trace])[0]),
                    "latent": teacher_greedy_reply(module, task, example, max_new_tokens=32,
                                                   composed=type(mine)(mine.latents[i:i + 1], mine.latent_mask[i:i + 1])),
                }
                for name, reply in replies.items():
                    contains[name] += int(task.score(example, reply) > 0)
                    result["replies"][name].append({"code": example.data["code"], "reply": reply})
        result["contains"] = {name: count / len(examples) for name, count in contains.items()}
    return result


def curve_point(step: int, point: dict[str, Any]) -> dict[str, Any]:
    """One point of ``curve``: the held-out ratios (bare code and sentence-prefixed) and the spread."""
    return {"step": step, "info_ratio_heldout": point["info_ratio"], "closing_ratio_heldout": point["closing_ratio"],
            "sentence_info_ratio_heldout": point["sentence"]["info_ratio"],
            "sentence_closing_ratio_heldout": point["sentence"]["closing_ratio"], "spread": point["spread"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default="smollm2-135m-instruct", help="a student as model.init_args.model takes it")
    parser.add_argument("--facts", type=int, default=64)
    parser.add_argument("--heldout", type=int, default=16)
    parser.add_argument("--num-latents", type=int, default=8, help="K")
    parser.add_argument("--steps", type=int, default=200, help="pretraining steps (the shipped configs' budget; "
                        "150 steps ran in 34 min here, 200 in 46-56 min)")
    parser.add_argument("--batch-size", type=int, default=8, help="facts per pretraining step")
    parser.add_argument("--curve-every", type=int, default=25, help="measure the held-out ratios every N steps")
    parser.add_argument("--paper", action="store_true", help="the paper's composer and warm start (see the docstring)")
    parser.add_argument("--architecture", default=None, help="composer_architecture (default: the module's)")
    parser.add_argument("--lr", type=float, default=None, help="warm_start_lr (default: the module's)")
    parser.add_argument("--reconstruction-weight", type=float, default=None,
                        help="warm_start_reconstruction_weight (default: the module's)")
    parser.add_argument("--reconstruction-noise", type=float, default=None,
                        help="warm_start_reconstruction_noise (default: the module's)")
    parser.add_argument("--lr-schedule", default=None, help="warm_start_lr_schedule (default: the module's)")
    parser.add_argument("--self-retrieval", default=None, type=lambda v: v.lower() in ("1", "true", "yes"),
                        help="warm_start_self_retrieval true|false (default: the module's)")
    parser.add_argument("--save-composer", type=Path, default=None, help="also save the pretrained composer here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "latent_capacity.json")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.curve_every < 1:
        parser.error("--steps and --curve-every must be >= 1")

    src = src_provenance()  # the code this run imports (before any later edit)
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    module, datamodule, task = build(args)
    module.train()
    train, heldout = task.examples("train"), task.examples("val")
    started = time.perf_counter()
    before = {"heldout": evaluate(module, task, heldout, greedy=True), "train": evaluate(module, task, train)}
    text = {split: {**{k: before[split][k] for k in ("none", "text", "text_wrong")},
                    "sentence": {k: before[split]["sentence"][k] for k in ("none", "text", "text_wrong")}}
            for split in before}
    print(f"untrained: held-out latent {before['heldout']['latent']:.2f}, wrong {before['heldout']['latent_wrong']:.2f}, "
          f"text {text['heldout']['text']:.2f}, none {text['heldout']['none']:.2f}", flush=True)
    curve = [curve_point(0, before["heldout"])]

    class Curve(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % args.curve_every == 0 and step < args.steps:
                point = evaluate(module, task, heldout, text=text["heldout"])
                curve.append(curve_point(step, point))
                print(f"step {step}: info {point['info_ratio']:.3f}, closing {point['closing_ratio']:.3f}, "
                      f"spread {point['spread']:.3f}", flush=True)

    from lopd_lightning.composer.pretrain import pretrain_composer

    with tempfile.TemporaryDirectory() as folder:
        info = pretrain_composer(module, datamodule, args.save_composer or folder, callbacks=[Curve()],
                                 trainer_options={"enable_progress_bar": False, "logger": False})
    after = {"heldout": evaluate(module, task, heldout, greedy=True, text=text["heldout"]),
             "train": evaluate(module, task, train, text=text["train"])}
    curve.append(curve_point(info["steps"], after["heldout"]))
    names = ("none", "text", "text_wrong", "latent", "latent_wrong")
    hp = module.hparams
    result = {
        **run_metadata(seed=args.seed, argv=sys.argv[1:] if argv is None else argv),
        **src,
        "student": args.student,
        "composer": {"architecture": module.composer.architecture, "output_gain": hp.composer_output_gain,
                     "warm_start_lr": hp.warm_start_lr,
                     "warm_start_task_weight": hp.warm_start_task_weight,
                     "warm_start_reconstruction_weight": hp.warm_start_reconstruction_weight,
                     "warm_start_self_retrieval": hp.warm_start_self_retrieval,
                     "warm_start_reconstruction_noise": hp.warm_start_reconstruction_noise,
                     "warm_start_lr_schedule": hp.warm_start_lr_schedule, "paper": args.paper,
                     "composer_lora": dict(hp.composer_lora or {}) or "default"},
        "n_train": len(train), "n_heldout": len(heldout), "num_latents": args.num_latents, "num_experiences": 1,
        "pretrain_steps": info["steps"], "pretrain_batch_size": args.batch_size, "pretrain_s": info["seconds"],
        "heldout": {k: after["heldout"][k] for k in names},
        "train": {k: after["train"][k] for k in names},
        "untrained": {"heldout": {k: before["heldout"][k] for k in names}, "train": {k: before["train"][k] for k in names},
                      "info_ratio_heldout": before["heldout"]["info_ratio"],
                      "closing_ratio_heldout": before["heldout"]["closing_ratio"],
                      "teacher_contains_heldout": before["heldout"]["contains"]},
        "info_ratio_heldout": after["heldout"]["info_ratio"],
        "closing_ratio_heldout": after["heldout"]["closing_ratio"],
        "info_ratio_train": after["train"]["info_ratio"],
        "sentence": {"heldout": {k: after["heldout"]["sentence"][k] for k in names},
                     "train": {k: after["train"]["sentence"][k] for k in names},
                     "untrained_heldout": {k: before["heldout"]["sentence"][k] for k in names},
                     "info_ratio_heldout": after["heldout"]["sentence"]["info_ratio"],
                     "closing_ratio_heldout": after["heldout"]["sentence"]["closing_ratio"]},
        "spread": after["heldout"]["spread"],
        "spread_untrained": before["heldout"]["spread"],
        "teacher_contains_heldout": after["heldout"]["contains"],
        "teacher_replies_heldout": after["heldout"]["replies"],
        "curve": curve,
        "wall_s": time.perf_counter() - started,
    }
    write_json_atomic(result, args.out)
    print(f"held-out: info {result['info_ratio_heldout']:.3f}, closing {result['closing_ratio_heldout']:.3f}, spread "
          f"{result['spread']:.3f} (untrained {result['spread_untrained']:.3f}), contains {result['teacher_contains_heldout']}"
          f" -> {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
