"""The evidence benchmarks: the start student's recipe (benchmarks/start_student.py) and the privileged
margin (benchmarks/privileged_margin.py): statistics against hand-derived values, and a tiny end-to-end
run of each on the toy task (seconds)."""

from __future__ import annotations

import json
import math
import time

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def margin():
    return load_benchmark("privileged_margin")


@pytest.fixture(scope="module")
def start():
    return load_benchmark("start_student")


# two questions: q1 mixed (a success with mean delta 0.4 over 2 tokens, a failure with -0.2 over 4), q2 two
# failures (0.1 over 1 token, 0.3 over 3); each trajectory is (reward, mean delta, delta sum, token count)
PER_QUESTION = {"q1": [(1.0, 0.4, 0.8, 2), (0.0, -0.2, -0.8, 4)], "q2": [(0.0, 0.1, 0.1, 1), (0.0, 0.3, 0.9, 3)]}


def test_margin_statistics_by_hand(margin):
    # A = 2r - 1: +1 * 0.4, -1 * -0.2, -1 * 0.1, -1 * 0.3 -> (0.4 + 0.2 - 0.1 - 0.3) / 4 = 0.05
    assert margin.trajectory_stats(PER_QUESTION) == pytest.approx(0.05)
    assert margin.trajectory_stats(PER_QUESTION, "success") == pytest.approx(0.4)
    assert margin.trajectory_stats(PER_QUESTION, "failure") == pytest.approx((0.2 - 0.1 - 0.3) / 3)
    assert margin.trajectory_stats(PER_QUESTION, "mixed") == pytest.approx((0.4 + 0.2) / 2)  # q1 only
    # separation, per token: successes 0.8 / 2 tokens; failures (-0.8 + 0.1 + 0.9) / (4 + 1 + 3) tokens
    assert margin.separation(PER_QUESTION) == pytest.approx(0.4 - 0.2 / 8)
    assert margin.separation({"q": [(0.0, 0.1, 0.1, 1)]}) is None
    assert margin.trajectory_stats({"q": [(0.0, 0.1, 0.1, 1)]}, "success") is None
    # balanced: successes 0.4 and failures (0.2 - 0.1 - 0.3) / 3 weighed equally; one side only: half of it
    assert margin.balanced_stats(PER_QUESTION) == pytest.approx(0.4 / 2 + (0.2 - 0.1 - 0.3) / 3 / 2)
    assert margin.balanced_stats({"q": PER_QUESTION["q2"]}) == pytest.approx((-0.1 - 0.3) / 2 / 2)
    assert margin.balanced_stats({}) is None


def test_bootstrap_interval_resamples_questions_and_covers_the_mean(margin):
    ci = margin.bootstrap_ci(PER_QUESTION, resamples=2000, seed=0)
    assert ci[0] <= 0.05 <= ci[1]
    # only two questions: every resample is q1q1, q1q2 or q2q2, so the interval's ends are those values
    q1q1, q2q2 = (0.4 + 0.2) / 2, (-0.1 - 0.3) / 2
    assert ci[0] == pytest.approx(q2q2) and ci[1] == pytest.approx(q1q1)
    assert margin.bootstrap_ci(PER_QUESTION, resamples=50, seed=3) == margin.bootstrap_ci(PER_QUESTION, resamples=50, seed=3)


def test_separation_and_mixed_group_intervals_resample_questions(margin):
    summary = margin.summarise(PER_QUESTION, resamples=2000, seed=0)
    # draws: q1q1 (both outcomes: separation 0.4 - (-0.2) = 0.6), q1q2 (the point estimate), q2q2 (failures
    # only: no separation, left out); so the interval's ends are 0.6 and 0.4 - 0.2 / 8
    assert summary["separation_ci"] == pytest.approx(sorted([0.6, 0.4 - 0.2 / 8]))
    # mixed groups: only q1 is mixed, so every draw with q1 gives (0.4 + 0.2) / 2 and q2q2 is left out
    assert summary["delta_mixed_groups_ci"] == pytest.approx([0.3, 0.3])
    assert summary["delta_ci"] == margin.bootstrap_ci(PER_QUESTION, resamples=2000, seed=0)


def test_random_context_is_never_the_question_own_solution(margin):
    from types import SimpleNamespace

    records = [SimpleNamespace(task_id=f"q{i}", trace=f"solution {i}") for i in range(3)]
    module = SimpleNamespace(bank=SimpleNamespace(records=records))
    drawn = {margin.random_record(module, seed, "q1").task_id for seed in range(40)}
    assert drawn == {"q0", "q2"}  # a train question's own solution would be the nearest, not a random, example
    assert margin.random_record(module, 7, "val/3") is margin.random_record(module, 7, "val/3")  # seeded by id


def test_the_journal_survives_a_line_cut_short_and_names_the_settings_that_differ(margin, tmp_path):
    key = {"task": "toy", "questions": ["q1", "q2"], "samples": 2}
    journal = margin.Journal(tmp_path, key, fresh=False)
    journal.append({"kind": "greedy", "who": "student", "id": "q1", "reward": 1.0})
    with journal.path.open("a") as f:  # a process killed while writing the next line
        f.write('{"kind": "greedy", "who": "student", "id": "q2", "rew')
    resumed = margin.Journal(tmp_path, key, fresh=False)
    assert resumed.greedy() == {("student", "q1"): 1.0}
    resumed.append({"kind": "greedy", "who": "student", "id": "q2", "reward": 0.0})
    assert margin.Journal(tmp_path, key, fresh=False).greedy() == {("student", "q1"): 1.0, ("student", "q2"): 0.0}
    with pytest.raises(SystemExit, match=r"with other settings \(questions, samples differ\); pass --fresh"):
        margin.Journal(tmp_path, {**key, "questions": ["q1"], "samples": 3}, fresh=False)
    journal.path.write_text('{"kind": "header", "key": {}}\nnot json\n')
    with pytest.raises(SystemExit, match="line 2 of .* is not JSON"):
        margin.Journal(tmp_path, {}, fresh=False)
    # timings: every line's seconds by phase; a start without its session line (an older journal) is incomplete
    journal = margin.Journal(tmp_path / "t", key, fresh=False)
    journal.check_fingerprints({"latent": 1.0})
    journal.append({"kind": "greedy", "who": "text_nearest", "id": "q1", "reward": 1.0, "seconds": 2.5})
    journal.append({"kind": "scores", "batch": 0, "rows": [], "seconds": 4.0})
    assert journal.timings() == ({"teacher_greedy_text_nearest_s": 2.5, "sample_and_score_s": 4.0}, 0, False)
    journal.append({"kind": "session", "seconds": {"setup_s": 1.0}})
    journal.append({"kind": "session", "seconds": {"setup_s": 0.5, "warm_start_s": 3.0}})
    assert journal.timings() == ({"teacher_greedy_text_nearest_s": 2.5, "sample_and_score_s": 4.0, "setup_s": 1.5,
                                  "warm_start_s": 3.0}, 2, True)


def test_dev_slice_is_carved_from_the_train_split_only(start):
    from lopd_lightning.tasks.toy import ToyTask

    task = ToyTask()
    view = start.dev_split_task(task, 4, seed=0)
    train, dev, heldout = view.examples("train"), view.examples("val"), view.examples("heldout")
    assert len(dev) == 4 and len(train) + 4 == len(task.examples("train"))
    assert {e.id for e in train} | {e.id for e in dev} == {e.id for e in task.examples("train")}
    assert not {e.id for e in train} & {e.id for e in dev}
    assert [e.id for e in heldout] == [e.id for e in task.examples("val")]  # never trained on, never chosen on
    ex = dev[0]
    assert view.initial_messages(ex) == task.initial_messages(ex) and view.reference_solution(ex) == task.reference_solution(ex)
    with pytest.raises(ValueError, match="--dev"):
        start.dev_split_task(task, 0, seed=0)


def test_start_student_then_margin_end_to_end_on_the_toy_task(start, margin, tmp_path):
    student, results = tmp_path / "student", tmp_path / "start_student.json"
    args = ["--task", "toy", "--model", "tiny", "--steps", "1,2", "--dev", "4", "--examples-per-step", "2",
            "--max-new-tokens", "6", "--out", str(student), "--results", str(results)]
    first = start.main(args)
    assert first["chosen_steps"] in (1, 2) and [c["steps"] for c in first["dev_curve"]] == [1, 2]
    assert first["heldout_questions"] == len(first["heldout_rewards"]) and (student / "config.json").exists()
    assert start.main(args)["timestamp"] == first["timestamp"]  # cached: the same recipe is not retrained
    out, work = tmp_path / "margin.json", tmp_path / "margin_work"
    margin_args = ["--task", "toy", "--student", str(student), "--questions", "3", "--samples", "2", "--batch-questions", "2",
                   "--warm-start-steps", "1", "--resamples", "20", "--max-new-tokens", "6", "--out", str(out),
                   "--work-dir", str(work)]
    data = margin.main(margin_args)
    assert json.loads(out.read_text())["n_questions"] == 3 == data["n_questions"]
    assert data["n_trajectories"] == 6 and data["contexts"]["latent_trained"] is None
    for split in ("heldout", "train"):  # the student's own NLL of the reference solutions, no context
        low, high = data[f"reference_nll_{split}_ci"]
        assert 0 < data[f"reference_nll_{split}"] and low <= data[f"reference_nll_{split}"] <= high
    for name in ("text_nearest", "text_random", "latent_untrained", "latent_warm_start"):
        entry = data["contexts"][name]
        assert set(entry) >= {"delta_mean", "delta_ci", "delta_success", "delta_failure", "delta_mixed_groups",
                              "delta_mixed_groups_ci", "separation", "separation_ci", "teacher_greedy_success",
                              "teacher_minus_student_greedy",
                              "teacher_minus_student_greedy_ci", "delta_balanced", "delta_balanced_ci"}
        # the greedy difference is the teacher's success minus the student's, on the same 3 questions
        assert entry["teacher_minus_student_greedy"] == pytest.approx(
            entry["teacher_greedy_success"] - data["student_greedy_success"])
        low, high = entry["teacher_minus_student_greedy_ci"]
        assert low <= entry["teacher_minus_student_greedy"] <= high
        for split in ("heldout", "train"):  # the reference solutions, teacher-forced under each context
            low, high = entry[f"reference_delta_{split}_ci"]
            assert math.isfinite(entry[f"reference_delta_{split}"]) and low <= entry[f"reference_delta_{split}"] <= high

    # a run stopped part-way continues from its journal: drop the last batch's scores and a teacher's answers,
    # run again, and every number is the same (the journal keeps what was finished; rollouts are seeded by
    # question); other settings are refused in one line
    journal = work / "journal.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    kept = [line for line in lines if not (line["kind"] == "scores" and line["batch"] == 1)
            and not (line["kind"] == "greedy" and line["who"] == "text_random")
            and not (line["kind"] == "reference" and line["split"] == "train" and line["batch"] == 0)
            and not (line["kind"] == "reference_nll" and line["split"] == "heldout")]  # as in a journal older than it
    journal.write_text("".join(json.dumps(line) + "\n" for line in kept))
    started = time.perf_counter()
    resumed = margin.main(margin_args)
    wall = time.perf_counter() - started
    for key in ("n_trajectories", "n_mixed_groups", "student_greedy_success", "reference_nll_heldout",
                "reference_nll_heldout_ci", "reference_nll_train", "reference_nll_train_ci"):
        assert resumed[key] == data[key]
    assert resumed["contexts"] == data["contexts"]
    # only the dropped work was done again, plus the resumed session's line
    assert len(journal.read_text().splitlines()) == len(lines) + 1
    # timings_s are summed over both sessions from the journal's own seconds: a naive sum over its lines
    final = [json.loads(line) for line in journal.read_text().splitlines()]
    assert resumed["timings_sessions"] == 2 and data["timings_sessions"] == 1 and resumed["timings_complete"]
    by_hand = {"sample_and_score_s": sum(l["seconds"] for l in final if l["kind"] == "scores"),
               "references_s": sum(l["seconds"] for l in final if l["kind"] in ("reference", "reference_nll")),
               "teacher_greedy_text_random_s": sum(l["seconds"] for l in final if l.get("who") == "text_random"),
               "setup_s": sum(l["seconds"]["setup_s"] for l in final if l["kind"] == "session")}
    for phase, seconds in by_hand.items():
        assert resumed["timings_s"][phase] == pytest.approx(seconds, abs=0.051) and seconds > 0
    assert resumed["timings_s"]["setup_s"] > data["timings_s"]["setup_s"]  # the second session's start counts too
    # the resumed session adds at most its own wall time (the dropped lines' seconds left with them)
    assert sum(resumed["timings_s"].values()) <= sum(data["timings_s"].values()) + wall + 0.5
    with journal.open("a") as f:  # a work line older than the seconds: its phase is marked incomplete
        f.write(json.dumps({"kind": "greedy", "who": "text_random", "id": "extra", "reward": 0.0}) + "\n")
    assert margin.Journal(work, json.loads(journal.read_text().splitlines()[0])["key"], fresh=False).timings()[2] is False
    journal.write_text("".join(line + "\n" for line in journal.read_text().splitlines()[:-1]))
    with pytest.raises(SystemExit, match="written with other settings.*--fresh"):
        margin.main([*margin_args, "--samples", "3"])
    assert margin.main([*margin_args, "--samples", "3", "--fresh"])["n_trajectories"] == 9
    # the investigation's variants: each a warm-started composer with one thing changed, measured as a context
    varied = margin.main([*margin_args, "--fresh", "--variants", "gain_embedding,k2+warm_2,k2+warm_0,k2+warm_2+lr0.05"])
    # the warm start really trains a variant's composer: with 0 steps its latents are different, and with
    # another learning rate (the same draws, the same initialisation) different again
    trained, untrained, faster = (varied["contexts"][f"latent_warm_start[{v}]"] for v in ("k2+warm_2", "k2+warm_0", "k2+warm_2+lr0.05"))
    assert trained["latent_rms"] != untrained["latent_rms"] and trained["delta_mean"] != untrained["delta_mean"]
    assert faster["latent_rms"] not in (trained["latent_rms"], untrained["latent_rms"])
    assert margin.parse_variant("lr3e-4+warm_7", warm_start_steps=2, num_latents=8) == {
        "output_gain": 1.0, "warm_start_steps": 7, "num_latents": 8, "composer_lr": 3e-4}
    assert "composer_lr" not in margin.parse_variant("warm_7", warm_start_steps=2, num_latents=8)  # kept keys unchanged
    for bad in ("lr0", "lr-1", "lrnan", "lrx", "lr0_05", "lr1e999"):
        with pytest.raises(SystemExit, match=f"--variants: unknown part '{bad}'"):
            margin.parse_variant(bad, warm_start_steps=2, num_latents=8)
    for name in ("latent_warm_start[gain_embedding]", "latent_warm_start[k2+warm_2]"):
        assert varied["contexts"][name]["teacher_greedy_success"] is not None and varied["contexts"][name]["latent_rms"] > 0
    # a variant starts at gain 1.0 unless it names gain_embedding (the module's own composer starts at the embeddings')
    assert varied["contexts"]["latent_warm_start[gain_embedding]"]["latent_rms"] < 0.5 * trained["latent_rms"]
    assert varied["contexts"]["latent_warm_start"] == resumed["contexts"]["latent_warm_start"]  # the module's own is untouched
    # the warm-started composers are kept in the work dir: a second run (here a fresh journal with two variants
    # fewer) loads them instead of warm-starting again, and scores the same composers
    assert sorted(p.name for p in (work / "composers").glob("*.pt")) == [
        "gain_embedding.pt", "k2_warm_0.pt", "k2_warm_2.pt", "k2_warm_2_lr0_05.pt", "latent_warm_start.pt"]
    from lopd_lightning.modules import LOPDModule

    def no_warm_start(self, datamodule=None):
        raise AssertionError("warm start repeated although its composer was kept")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LOPDModule, "warm_start_composer", no_warm_start)
        again = margin.main([*margin_args, "--fresh", "--variants", "gain_embedding,k2+warm_2+lr0.05"])
        with pytest.raises(AssertionError, match="warm start repeated"):  # kept under another seed: not used
            margin.main([*margin_args, "--fresh", "--seed", "1"])
    for name in ("latent_warm_start", "latent_warm_start[gain_embedding]", "latent_warm_start[k2+warm_2+lr0.05]"):
        assert again["contexts"][name] == varied["contexts"][name]
    # the train references are the questions the warm start drew: its draws replayed, checked against the draws
    # a real warm start makes (its reference batches, recorded)
    drawn: list[str] = []
    reference_batch = LOPDModule.reference_batch

    def recording(self, task, examples):
        drawn.extend(example.id for example in examples)
        return reference_batch(self, task, examples)

    for path in (work / "composers").glob("*.pt"):
        path.unlink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LOPDModule, "reference_batch", recording)
        margin.main([*margin_args, "--fresh", "--warm-start-steps", "3"])
    warm = drawn[: 3 * 2]  # warm_start_steps batches of warm_start_batch_size, before the reference batches
    built = margin.build_module(margin.argparse.Namespace(student=student, samples=2, max_new_tokens=6, num_latents=8,
                                                          num_experiences=2, warm_start_steps=3, seed=0))
    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.tasks import get_task

    task = get_task("toy")
    margin.fill_bank(built, task)
    replayed = margin.warm_start_examples(built, OnPolicyDataModule(task, examples_per_step=1, seed=0), 100)
    assert [e.id for e in replayed] == list(dict.fromkeys(warm)) and replayed
    # the student's reference NLL against a naive one: a log-softmax of the plain forward under the student's weights
    import torch

    batch = built.reference_batch(task, replayed[:2])
    with torch.no_grad(), built.student_context() as model:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps = torch.log_softmax(logits[:, :-1].double(), dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.assistant_mask[:, 1:].bool()
    for row, (mean, total, n) in enumerate(margin.student_reference_nll(built, batch)):
        want = -logps[row][mask[row]]
        assert n == int(mask[row].sum()) > 0
        assert mean == pytest.approx(float(want.mean()), abs=1e-5) and total == pytest.approx(float(want.sum()), abs=1e-4)
    with pytest.raises(SystemExit, match="--variants: unknown part 'gain2'"):
        margin.main([*margin_args, "--fresh", "--variants", "gain2"])

    # trained composers (here: the built module's composer, perturbed per "seed" and saved as an LOPD checkpoint
    # holds it): the first checkpoint is latent_trained, the others latent_trained[<run>], and their numbers'
    # mean over seeds; --contexts measures only those, on the same sampled trajectories as a full run
    checkpoints = []
    for i, run in enumerate(("seed_0", "seed_1", "seed_2")):
        torch.manual_seed(i)
        with torch.no_grad():  # the resampler and the composer's LoRA: a snapshot must copy both
            for p in [*built.composer.compressor.parameters(), *built.composer.lora_parameters()]:
                p.add_(0.5 * torch.randn_like(p))
        path = tmp_path / "lopd" / run / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        torch.save({"state_dict": {k: v for k, v in built.state_dict().items()
                                   if k.startswith("composer.") or ".composer." in k}}, path)  # resampler and LoRA
        checkpoints.append(str(path))
    # a composer of `lopd pretrain-composer` (here the last perturbed one, saved as the stage saves it) is
    # latent_pretrained: the same numbers as the same composer read from an LOPD checkpoint
    from lopd_lightning.composer import save_composer

    save_composer(built.composer, tmp_path / "pretrained")
    pretrained = margin.main([*margin_args[:-4], "--out", str(tmp_path / "pretrained.json"), "--work-dir",
                              str(tmp_path / "pw"), "--contexts", "latent_pretrained,latent_trained",
                              "--composer-path", str(tmp_path / "pretrained"), "--trained-checkpoint", checkpoints[2]])
    assert pretrained["contexts"]["latent_pretrained"] == pretrained["contexts"]["latent_trained"]
    # the question's own reference (a record of a bank used only here), as text and as the same composer's latents
    # in the first of the J slots, in the long framing: measured on the same trajectories as the other contexts
    refs = margin.main([*margin_args[:-4], "--out", str(tmp_path / "reference.json"), "--work-dir", str(tmp_path / "rw"),
                        "--contexts", "text_reference,latent_reference,latent_pretrained", "--composer-path",
                        str(tmp_path / "pretrained"), "--context-framing", "from_scratch"])
    assert refs["settings"]["own_reference_records"] == 3 and refs["settings"]["context_framing"] == "from_scratch"
    assert list(refs["contexts"]) == ["text_reference", "latent_pretrained", "latent_reference"]
    for entry in refs["contexts"].values():
        assert entry["teacher_greedy_success"] is not None
        assert math.isfinite(entry["reference_delta_heldout"])
    assert refs["contexts"]["latent_reference"]["delta_mean"] != refs["contexts"]["latent_pretrained"]["delta_mean"]
    assert refs["contexts"]["text_reference"]["reference_delta_heldout"] > 0  # reading the answer raises it
    with pytest.raises(SystemExit):
        margin.main([*margin_args, "--composer-path", str(tmp_path / "nothing")])
    single = margin.main([*margin_args, "--fresh", "--trained-checkpoint", checkpoints[0]])
    only = margin.main([*margin_args[:-4], "--out", str(tmp_path / "trained.json"), "--work-dir", str(tmp_path / "tw"),
                        "--contexts", "latent_trained", "--trained-checkpoint", *checkpoints])
    assert list(only["contexts"]) == ["latent_trained", "latent_trained[lopd/seed_1]", "latent_trained[lopd/seed_2]"]
    assert only["contexts"]["latent_trained"] == single["contexts"]["latent_trained"]  # same composer, same trajectories
    assert only["n_trajectories"] == single["n_trajectories"]
    over = only["latent_trained_over_seeds"]
    values = [only["contexts"][name]["delta_mean"] for name in over["contexts"]]
    assert len(set(values)) == 3 and over["delta_mean"]["values"] == values
    assert over["delta_mean"]["mean"] == pytest.approx(sum(values) / 3)
    low, high = over["delta_mean"]["ci"]
    assert low < over["delta_mean"]["mean"] < high
    assert "latent_trained_over_seeds" not in single
    with pytest.raises(SystemExit):
        margin.main([*margin_args, "--contexts", "latent_traind"])
    with pytest.raises(SystemExit):  # a bracketed name this run has no composer for
        margin.main([*margin_args, "--contexts", "latent_trained[lopd/seed_9]", "--trained-checkpoint", checkpoints[0]])
    incomplete = tmp_path / "incomplete.ckpt"
    state = torch.load(checkpoints[1], weights_only=False)["state_dict"]
    torch.save({"state_dict": dict(list(state.items())[1:])}, incomplete)
    with pytest.raises(ValueError, match="missing keys"):
        margin.load_trained_composer(built, incomplete)
    # the journal key's format with one checkpoint and every context is that of journals written before
    key = margin.journal_key(margin.argparse.Namespace(
        task="toy", student=student, samples=2, num_latents=8, num_experiences=2, warm_start_steps=1, max_new_tokens=6,
        batch_questions=2, seed=0, trained_checkpoint=[checkpoints[0]], variants="", contexts=""), [])
    assert key["trained_checkpoint"] == margin.file_stamp(checkpoints[0]) and "contexts" not in key
    with pytest.raises(SystemExit):
        margin.main([*margin_args, "--trained-checkpoint", str(tmp_path / "missing.ckpt")])


def test_reference_experiences_put_the_questions_own_record_first(margin):
    """Self-retrieval as the measurement builds it: the question's own record (never in the bank), then its
    J - 1 nearest bank experiences."""
    from types import SimpleNamespace

    from lopd_lightning.memory import Experience

    own = Experience(task_id="q", task_text="t", trace="own", reward=1.0)
    others = [Experience(task_id=f"o{i}", task_text="t", trace=f"other {i}", reward=1.0) for i in range(3)]
    module = SimpleNamespace(retrieve=lambda task, examples: [others], hparams=SimpleNamespace(num_experiences=3))
    example = SimpleNamespace(id="q")
    assert [e.trace for e in margin.reference_experiences(module, None, example, {"q": own})] == \
        ["own", "other 0", "other 1"]
    assert [e.trace for e in margin.reference_experiences(module, None, example, {})] == \
        ["other 0", "other 1", "other 2"]
