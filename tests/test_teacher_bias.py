"""benchmarks/teacher_bias.py: where the self-teacher disagrees with the student on the student's own replies.

A tiny random LOPD module on a small hidden_rules, its checkpoint written with a perturbed composer and student:
the teacher without context equals the student (the alignment check), the student's log-ratio of the
schema-copying reply equals a plain forward's, and the latents do change the teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TASK = {"n_train": 24, "n_heldout": 4}


@pytest.fixture(scope="module")
def bias():
    return load_benchmark("teacher_bias")


def test_the_corrupted_reply_adds_the_schema_required_list_inside_arguments(bias):
    reply = '<tool_call>[{"name": "f", "arguments": {"a": "x", "b": 3}}]</tool_call>'
    system = 'tools <tools>[{"name": "f", "parameters": {"required": ["a", "b"]}}]</tools>'
    assert bias.schema_required(system, reply) == ["a", "b"]
    assert bias.schema_required("no tools here", reply) == []
    corrupt = bias.corrupt_reply(reply, ["a", "b"])
    assert corrupt == '<tool_call>[{"name": "f", "arguments": {"a": "x", "b": 3, "required": ["a", "b"]}}]</tool_call>'
    assert json.loads(corrupt[len("<tool_call>"):-len("</tool_call>")])[0]["arguments"]["required"] == ["a", "b"]
    assert bias.corrupt_reply("<tool_call>[]</tool_call>", ["a"]) is None
    # the closing token: the first piece holding "}" once "arguments" has been written
    assert bias.close_index(['{"', 'name', '": "f", "', 'arguments', '": {"a": 1', '}}', ']']) == 5
    assert bias.close_index(['{"a": 1', '}}']) is None


def test_the_bootstrap_covers_the_mean_and_counts_positive_values(bias):
    out = bias.bootstrap([1.0, -1.0, 2.0, 2.0], resamples=500, seed=0)
    assert out["mean"] == 1.0 and out["n"] == 4 and out["positive_fraction"] == 0.75
    assert out["ci"][0] <= 1.0 <= out["ci"][1]
    assert bias.bootstrap([], resamples=10, seed=0) == {"mean": None, "ci": None, "n": 0}


def tiny_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder (config.yaml, checkpoints/last.ckpt with a moved student and composer) and a generations
    file of the held-out reference replies in the runs' format."""
    from lopd_lightning.cli import main as lopd
    from lopd_lightning.modules import LOPDModule
    from lopd_lightning.tasks import get_task

    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("common.yaml", "lopd.yaml"):
        text = (ROOT / "configs" / "experience_tiny" / name).read_text()
        (configs / name).write_text(text.replace("runs/experience_tiny", str(tmp_path / "work")))
    assert lopd(["build-memory", "-c", str(configs / "common.yaml"), "-c", str(configs / "lopd.yaml"),
                 "--model.init_args.composer_path=null", "--from-references"]) == 0
    assert lopd(["pretrain-composer", "-c", str(configs / "common.yaml"), "-c", str(configs / "lopd.yaml"),
                 "--model.init_args.composer_path=null", "--out", str(tmp_path / "work" / "composer"), "--steps", "1"]) == 0
    torch.manual_seed(0)
    module = LOPDModule("tiny", lora=LORA, num_latents=4, num_experiences=2, composer_depth=2, max_experience_tokens=64,
                        embedder="hashing", bank_path=str(tmp_path / "work" / "bank"), warm_start_steps=0,
                        composer_path=str(tmp_path / "work" / "composer"), distill_top_k=8, seed=0)
    with torch.no_grad():  # a trained run's state: the student's LoRA and the composer moved from the start
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    run = tmp_path / "run"
    trainer = quiet_trainer(tmp_path)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(run / "checkpoints" / "last.ckpt")
    (run / "config.yaml").write_text(json.dumps({"data": {"init_args": {"task": "hidden_rules", "task_options": TASK}}}))
    task = get_task("hidden_rules", **TASK)
    lines = []
    for ex in task.examples("val"):
        messages, reward = module.reference_trajectory(task, ex)
        lines.append(json.dumps({"example_id": ex.id, "reward": reward, "messages": messages}))
    replies = run / "val_step_0.jsonl"
    replies.write_text("\n".join(lines) + "\n")
    return run, replies


def plain_batch(bias, module, task, rows, *, corrupt: bool = False):
    """The rows' conversations as one batch, with their task text and retrieved experiences."""
    from lopd_lightning.rollout import batch_from_conversations

    examples = [next(ex for ex in task.examples("val") if ex.id == row["example_id"]) for row in rows]
    conversations = []
    for row in rows:
        system, _, reply = (m["content"] for m in row["messages"])
        reply = bias.corrupt_reply(reply, bias.schema_required(system, reply)) if corrupt else reply
        conversations.append([*row["messages"][:2], {"role": "assistant", "content": reply}])
    batch = batch_from_conversations(module.tokenizer, conversations, rewards=[1.0] * len(rows),
                                     group_ids=list(range(len(rows))), example_ids=[ex.id for ex in examples],
                                     tools=[task.tools(ex) for ex in examples])
    module.annotate(batch, examples)
    batch.experiences = module.retrieve(task, examples)
    return batch


def naive_logps(module, batch, **teacher):
    """(B, T-1) log-probabilities of each next token from one full forward, no prefix cache, no packing:
    the student's (a plain backbone call) or, with ``teacher`` keyword arguments, the teacher's."""
    with torch.no_grad():
        if teacher:
            logits = module.teacher.logits_on_student_positions(batch.input_ids, batch.attention_mask,
                                                                batch.context_position, **teacher)
        else:
            with module.student_context():
                logits = module.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return logits[:, :-1].log_softmax(-1)


def test_the_measures_equal_a_naive_full_forward_and_each_context_does_what_it_says(bias, tmp_path):
    from lopd_lightning.tasks import get_task

    run, replies = tiny_run(tmp_path)
    out = tmp_path / "bias.json"
    data = bias.main(["--run", str(run), "--replies", str(replies), "--questions", "3", "--batch-questions", "3",
                      "--resamples", "100", "--out", str(out)])
    assert json.loads(out.read_text())["states"].keys() == {"start", "end", "end_composer"}
    assert len(data["questions"]) == 3 and data["src_hash"]
    for state, summary in data["states"].items():
        none = summary["none"]
        assert none["alignment_max_abs_logp"] < 1e-4, state
        assert abs(none["logp_delta"]["mean"]) < 1e-5 and abs(none["required_logratio_delta"]["mean"]) < 1e-4
        # the framing alone, the latents, and the next question's latents each give another teacher (a tiny
        # random model's outputs are near uniform: the changes are small, not zero)
        assert summary["framing_only"]["reverse_kl"]["mean"] > 0 and summary["latent"]["reverse_kl"]["mean"] > 0
        assert summary["latent"]["logp_delta"]["mean"] != summary["framing_only"]["logp_delta"]["mean"]
        assert summary["latent"]["logp_delta"]["mean"] != summary["latent_wrong"]["logp_delta"]["mean"]
    start, end, mixed = (data["states"][s] for s in ("start", "end", "end_composer"))
    # the end state's student is the checkpoint's; the end_composer state keeps the start student
    assert end["none"]["required_logratio_student"]["mean"] != pytest.approx(start["none"]["required_logratio_student"]["mean"])
    assert mixed["none"]["required_logratio_student"]["mean"] == pytest.approx(start["none"]["required_logratio_student"]["mean"])
    assert mixed["latent"]["logp_delta"]["mean"] != pytest.approx(start["latent"]["logp_delta"]["mean"], abs=1e-9)

    # the start state against one full forward per side, no prefix cache, the same one batch of 3 (the tiny
    # model's 2048 positions cut the longest rows' contexts by the padded length, so the batch must match)
    task = get_task("hidden_rules", **TASK)
    module, _ = bias.build_state("start", run / "checkpoints" / "last.ckpt")
    rows = bias.read_replies(replies, 3)
    clean, corrupt = plain_batch(bias, module, task, rows), plain_batch(bias, module, task, rows, corrupt=True)
    composed = module.batch_latents(clean)
    latent = {"latents": composed.latents, "latent_mask": composed.latent_mask}
    targets, mask = module.shifted(clean)
    s = naive_logps(module, clean).gather(-1, targets[..., None])[..., 0]
    t = naive_logps(module, clean, **latent).gather(-1, targets[..., None])[..., 0]
    per_row = ((t - s) * mask).sum(1) / mask.sum(1)
    assert start["latent"]["logp_delta"]["mean"] == pytest.approx(float(per_row.mean()), abs=1e-5)
    ratios = []
    for b, kwargs in ((clean, latent), (corrupt, {"latents": composed.latents, "latent_mask": composed.latent_mask})):
        tg, mk = module.shifted(b)
        ratios.append([(naive_logps(module, b, **kw).gather(-1, tg[..., None])[..., 0] * mk).sum(1) for kw in ({}, kwargs)])
    naive_ratio = (ratios[1][1] - ratios[0][1]) - (ratios[1][0] - ratios[0][0])
    assert start["latent"]["required_logratio_delta"]["mean"] == pytest.approx(float(naive_ratio.mean()), abs=1e-4)
    assert start["none"]["required_logratio_student"]["mean"] == pytest.approx(float((ratios[1][0] - ratios[0][0]).mean()), abs=1e-4)
    # the closing token: the student's comma mass where the reply's "}}" closes arguments, found by hand
    comma = bias.comma_token_ids(module.tokenizer)
    probs = naive_logps(module, clean).exp()
    masses = []
    for r, row in enumerate(rows):
        positions = mask[r].nonzero()[:, 0]
        pieces = [module.tokenizer.decode([int(targets[r, p])]) for p in positions]
        text = "".join(pieces)
        closing = text.index("}", text.index('"arguments"'))
        i = next(k for k in range(len(pieces)) if len("".join(pieces[: k + 1])) > closing)
        masses.append(float(probs[r, positions[i], comma].sum()))
    assert start["none"]["comma_mass_student"]["n"] == 3
    assert start["none"]["comma_mass_student"]["mean"] == pytest.approx(sum(masses) / 3, abs=1e-6)


def test_bad_input_is_one_line_naming_the_flag(bias, tmp_path):
    replies = tmp_path / "r.jsonl"
    replies.write_text("")
    run = tmp_path / "run"

    def refused(args, expected):
        with pytest.raises(SystemExit, match=expected):
            bias.main(["--run", str(run), "--replies", str(replies), *args])

    refused([], "^error: --run: no folder")
    run.mkdir()
    refused([], "^error: --checkpoint: no file")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    refused(["--contexts", "latnet"], "^error: --contexts: unknown latnet; known: none, framing_only")
    refused(["--states", ","], "^error: --states: empty")
    refused(["--batch-questions", "0"], "^error: --batch-questions: must be at least 1")
    refused([], "^error: --run: .*config.yaml is not a run's config")
    (run / "config.yaml").write_text("data: {init_args: {task: hidden_rules}}\n")
    refused([], "^error: --replies: .* has no single-turn reply")
    replies.write_text("{not json\n")
    refused([], "^error: --replies: line 1 of .* is not a generations record")
    reply = '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>'
    record = {"example_id": "hidden_rules/val/0", "reward": 0.0,
              "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": reply}]}
    replies.write_text(json.dumps(record) + "\n")
    refused([], "^error: --questions: latent_wrong needs at least 2 different questions")


def test_the_start_state_of_a_run_that_warm_started_its_composer_inside_fit_is_refused(bias, tmp_path):
    from lopd_lightning.modules import LOPDModule

    module = LOPDModule("tiny", lora=LORA, num_latents=4, num_experiences=2, composer_depth=2, embedder="hashing",
                        warm_start_steps=2, seed=0)  # no composer_path: fit would warm-start it and keep no copy
    trainer = quiet_trainer(tmp_path)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(bias.InputError, match="^--states: start needs a run with model.init_args.composer_path"):
        bias.build_state("start", tmp_path / "last.ckpt")
    assert bias.build_state("end_composer", tmp_path / "last.ckpt")[1] == 0
