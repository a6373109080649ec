"""`temper config show` and `temper run --dry-run` as a person types them: what a config resolves to and
what a run would start, before anything starts; and a bad value refused the same way by all three.

Most tests call the CLI's ``main`` with the argv a shell would pass (no process: the fast tier); the
last ones run the `temper` command itself.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tomllib

import pytest

from temper.cli.main import main
from temper.cli.plan import toml_table, toml_value
from temper.learner.config import LearnerConfig
from temper.runtime.launcher import SERVICES

LOG_LEVEL_ENV = [f"TEMPER_{s.upper()}_LOG_LEVEL" for s in SERVICES]


@pytest.fixture
def temper(capsys, monkeypatch, tmp_path):
    """``temper(*argv)`` -> (exit code, stdout, stderr), in a private home; the environment is restored."""
    for name in [*LOG_LEVEL_ENV, "TEMPER_LEARNER_LR"]:  # main sets these for --log-level: restore them after
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEMPER_HOME", str(tmp_path / "home"))

    def run(*argv: str):
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _line(text: str, table: str, key: str) -> str:
    """The line of ``key`` in ``[table]`` of config show's output."""
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.split("  #")[0] == f"[{table}]"))
    for line in lines[start + 1:]:
        if line.startswith("["):
            break
        if line.startswith(f"{key} = "):
            return line
    raise AssertionError(f"no {key} in [{table}]")


def test_config_show_prints_every_service_and_the_job_as_toml_with_sources(temper, tmp_path):
    code, out, err = temper("config", "show")
    assert code == 0, err
    cfg = tomllib.loads(out)
    assert list(cfg) == ["job", "model", *SERVICES]
    assert cfg["job"]["steps"] == 150 and cfg["job"]["eval"]["size"] == 100       # the shipped toy.toml
    assert cfg["learner"]["lr"] == 0.001 and cfg["inference"]["engine"] == "hf"
    assert cfg["learner"]["kl_coef"] == LearnerConfig.model_fields["kl_coef"].default  # not in the file
    assert cfg["learner"]["groups_per_step"] == 16                                     # [job].prompts_per_step
    assert cfg["model"]["dir"] == str(tmp_path / "home" / "models" / "tiny") == cfg["learner"]["model_dir"]
    assert cfg["replay"]["tables"]["default"]["sampler"] == "fifo"
    assert _line(out, "learner", "lr").endswith("# file")
    assert _line(out, "learner", "kl_coef").endswith("# default")
    assert _line(out, "learner", "port_file").endswith("# flag (launcher)")
    assert "launcher at start: the address replay reports" in _line(out, "learner", "replay_address")
    assert _line(out, "job", "response_prefix").endswith("# default")
    assert not (tmp_path / "home").exists()  # nothing built, nothing started


def test_config_show_environment_flags_and_a_file_of_ones_own(temper, tmp_path, monkeypatch):
    mine = tmp_path / "my.toml"
    mine.write_text('[job]\nsteps = 7\ndomains = ["toy.copy"]\n[model]\npreset = "tiny"\nlayers = 1\n'
                    '[inference]\nengine = "hf"\n[learner]\nlr = 0.01\nepochs = 1\n')
    monkeypatch.setenv("TEMPER_LEARNER_LR", "5e-4")  # environment over file
    code, out, err = temper("config", "show", "--config", str(mine), "--seed", "3", "--log-level", "DEBUG")
    assert code == 0, err
    cfg = tomllib.loads(out)
    assert cfg["learner"]["lr"] == 0.0005 and _line(out, "learner", "lr").endswith("# env TEMPER_LEARNER_LR")
    assert cfg["learner"]["epochs"] == 1 and _line(out, "learner", "epochs").endswith("# file")
    assert cfg["job"]["steps"] == 7 and cfg["job"]["seed"] == 3 and _line(out, "job", "seed").endswith("# flag --seed")
    assert cfg["job"]["prompts_per_step"] == 16 and _line(out, "job", "prompts_per_step").endswith("# default")
    assert cfg["model"]["layers"] == 1 and cfg["model"]["hidden_size"] == 64
    assert _line(out, "model", "hidden_size").endswith("# default")
    assert all(cfg[s]["log_level"] == "DEBUG" for s in SERVICES)  # --log-level reaches every service
    code, out2, _ = temper("--config", str(mine), "config", "show")  # the global option before the subcommand
    assert code == 0 and tomllib.loads(out2)["job"]["steps"] == 7


def test_config_show_names_table_and_key_of_a_bad_value(temper, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\npreset = "tiny"\n[learner]\nlr = "fast"\npolicy_loss = "ppo"\nkl_coeff = 0.1\n'
                   '[replay.tables.default]\nsampler = "fifox"\nmax_sise = 10\n')
    monkeypatch.setenv("TEMPER_SANDBOX_MAX_QUEUE", "lots")
    code, out, err = temper("config", "show", "--config", str(bad))
    assert code == 1 and out == "" and "Traceback" not in err
    assert f"temper: {bad}: invalid configuration:" in err
    assert "[learner] lr: Input should be a valid number" in err and "(got 'fast')" in err
    assert "[learner] policy_loss: unknown policy loss 'ppo'; known: ['gspo', 'ppo_clip']" in err
    assert "[learner] kl_coeff: unknown key (did you mean kl_coef?)" in err
    assert "[replay] tables.default.sampler: Input should be 'fifo', 'lifo', 'uniform' or 'prioritized'" in err
    assert "[sandbox] max_queue:" in err and "[from env TEMPER_SANDBOX_MAX_QUEUE]" in err
    # an unknown key of a nested table lists that table's keys
    assert "[replay] tables.default.max_sise: unknown key (did you mean max_size?); known: domain_quotas," in err


def test_dry_run_prints_the_plan_of_the_default_job_and_starts_nothing(temper, tmp_path):
    code, out, err = temper("run", "--dry-run")
    assert code == 0, err
    assert "nothing was started" in out
    assert "wave 1: inference, sandbox, replay\n" in out
    assert "wave 2: reward (needs sandbox), learner (needs inference, replay)" in out
    assert "wave 3: scheduler (needs inference, reward)" in out and "wave 4: monitor (needs scheduler)" in out
    assert "the tiny preset (hidden_size 64, layers 2, heads 2, seed 0, context 128)" in out and "built at start" in out
    assert "150 steps x 16 prompts x 8 samples (group_size) = 128 samples per step, 19200 in all" in out
    assert "toy.copy: the family's defaults" in out
    assert "100 held-out problems per domain (2 domains), seed 1000003" in out
    assert "start-up timeout 180 s; job timeout 1800 s" in out
    assert not (tmp_path / "home").exists()


def test_dry_run_shows_domain_knobs_eval_and_overrides(temper, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 40\nprompts_per_step = 4\ngroup_size = 6\ndomains = ["rg.chain_sum", "toy.copy"]\n'
                   '[job.domain_config."rg.chain_sum"]\nmin_terms = 2\nmax_terms = 3\n'
                   '[job.eval]\nsize = 10\nevery = 5\nextra_domains = ["toy.next"]\n'
                   '[model]\npreset = "tiny"\n[learner]\nadvantage = "rloo"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job), "--steps", "12", "--job-timeout", "600")
    assert code == 0, err
    assert "12 steps x 4 prompts x 6 samples (group_size) = 24 samples per step, 288 in all" in out
    assert "rg.chain_sum: max_terms = 3, min_terms = 2" in out and "toy.next (eval only)" in out
    assert "10 held-out problems per domain (3 domains; eval-only: toy.next)" in out and "every 5 policy" in out
    assert "advantage rloo" in out and "engine vllm" in out  # the service default when [inference] says nothing
    assert "job timeout 600 s" in out


def test_dry_run_shows_the_sampling_plan(temper, tmp_path):
    """The scheduler's sampling as it will start: the policies on, each domain's draw probability and
    curriculum level; a job without [job.sampling] is told it draws by weights alone."""
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 2\ndomains = ["rg.chain_sum", "rg.gcd", "toy.copy"]\n'
                   '[job.sampling]\nweights = {"rg.gcd" = 2.0}\npass_threshold = 0.5\n'
                   '[job.sampling.curriculum]\nwindow = 8\n[job.sampling.adaptive]\nfloor = 0.05\n'
                   '[job.sampling.dynamic_sampling]\nmax_refill_ratio = 1.5\n[model]\npreset = "tiny"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    head = _plan_line(out, "sampling")
    assert "curriculum (window 8, raise_above 0.8, lower_below 0.2, start_level 0)" in head
    assert 'adaptive (window 16, signal "progress", floor 0.05)' in head
    assert "dynamic_sampling (max_refill_ratio 1.5)" in head and "a sample passes at reward >= 0.5" in head
    # p_d = floor + (1 - 3 floor) w_d / sum w: 0.05 + 0.85 * 2/4 for rg.gcd, 0.05 + 0.85/4 for the others
    assert "starting draw probabilities rg.chain_sum 0.263, rg.gcd 0.475, toy.copy 0.263" in out
    assert "rg.chain_sum: curriculum level 0 of " in out and "rg.gcd: curriculum level 0 of " in out
    assert "toy.copy: curriculum" not in out  # no ladder: no level
    code, out, err = temper("run", "--dry-run", "--job", "toy")
    assert code == 0, err
    assert _plan_line(out, "sampling") == "no [job.sampling] policy: domains drawn by their weights alone"
    assert "starting draw probability 0.5 for each of 2 domains" in out


def _plan_line(out: str, head: str) -> str:
    """The dry run's line that starts with ``head`` (a 10-column label), without the label."""
    return next(line[10:] for line in out.splitlines() if line.startswith(f"{head:<10}"))


def test_step_labels_table_in_the_plan_and_config_show(temper, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 2\n[job.step_labels]\nbudget = 512\nk = 3\nlabel = "hard"\ndelimiter = "\\n"\n'
                   '[model]\npreset = "tiny"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert ('labels    `temper prm label/grow` step labels: budget 512 rollouts, k 3 per step prefix, hard labels, '
            'threshold 1, 2..64 steps, delimiter "\\n" ([job.step_labels] sets k, budget, label, delimiter') in out
    code, out, err = temper("config", "show", "--config", str(job))
    assert code == 0, err
    shown = tomllib.loads(out)["job"]["step_labels"]
    assert shown == {"k": 3, "budget": 512, "label": "hard", "threshold": 1.0, "min_steps": 2, "max_steps": 64,
                     "delimiter": "\n"}
    assert _line(out, "job.step_labels", "budget").endswith("# file")
    plain = tmp_path / "plain.toml"
    plain.write_text('[job]\nsteps = 2\n[model]\npreset = "tiny"\n')
    code, plain_out, err = temper("run", "--dry-run", "--config", str(plain))
    assert code == 0, err
    assert "labels    " not in plain_out  # a job that labels no steps is not told about labelling
    assert _line(out, "job.step_labels", "threshold").endswith("# default")
    code, out, _ = temper("config", "show")  # no table: the defaults, delimiter the reward config's
    assert "# delimiter is unset  (default: each domain's [reward.domains.NAME].step_delimiter" in out
    job.write_text('[job]\nsteps = 2\n[job.step_labels]\nbudget = 512\nrollouts = 3\n')
    for argv in (["run", "--dry-run"], ["config", "show"]):
        code, out, err = temper(*argv, "--config", str(job))
        assert code == 1 and "job.step_labels.rollouts: unknown key; allowed: k, budget, label," in err, err
        assert "Traceback" not in err and not out


def test_dry_run_of_a_model_folder_describes_it(temper, tmp_path):
    from temper.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "my-model")
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nsteps = 2\n[model]\ndir = "{folder}"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert f"{folder} (a model folder, used as it is): LlamaForCausalLM" in out and "chat template no" in out


def test_dry_run_refuses_what_run_refuses(temper, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[job]\nsteps = 0\n")
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "[job] steps: must be in [1," in err and "plan" not in out
    job.write_text('[job]\nsteps = 2\n[model]\ndir = "/nonexistent/model"\n')
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "model.dir: /nonexistent/model is not a folder" in err
    code, _, err = temper("config", "show", "--job", "toy", "--config", str(job))
    assert code == 1 and "give --config FILE or --job NAME, not both" in err


def test_dry_run_shows_a_dataset_domain_and_refuses_a_bad_row(temper, tmp_path):
    (tmp_path / "data").mkdir()
    rows = tmp_path / "data" / "mymath.jsonl"
    rows.write_text("".join(f'{{"question": "What is {i} + {i}?", "answer": "{2 * i}"}}\n' for i in range(10)))
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 2\ndomains = ["data.mymath", "toy.copy"]\n'
                   '[job.domain_config."data.mymath"]\npath = "data/mymath.jsonl"\n'  # from the job file's folder
                   'prompt_field = "question"\nanswer_field = "answer"\nverifier = "math"\neval_fraction = 0.2\n'
                   'instruction = "Put your final answer in \\\\boxed{}."\n'
                   '[job.eval]\nsize = 2\n[model]\npreset = "tiny"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert (f"data.mymath: dataset {rows} (jsonl): 10 rows, 8 train, 2 held out (eval_fraction 0.2); prompt "
            f"'question', answer 'answer'; verifier math; instruction = \"Put your final answer in \\\\boxed{{}}.\"") in out
    assert "toy.copy: the family's defaults" in out
    rows.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "What is 2 + 2?"}\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "plan" not in out
    assert f"[job] domain_config[data.mymath].answer_field: {rows} row 2 (line 2) has no field 'answer'" in err
    rows.unlink()
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and f"domain_config[data.mymath].path: no such file or folder: {rows}" in err


def test_toml_values_round_trip():
    values = {"s": 'quote " back \\ tab \t nl \n ü \x7f', "i": -3, "f": 1e-06, "big": 1e300, "inf": math.inf,
              "b": False, "l": [1, "a", [2.5]], "empty": {}, "inline": {"a.b": 1, "c d": "x"},
              "nested": {"x": {"y": {"z": 1}, "w": 2}, "v": 0}, "none": None, "dotted.key": "k"}
    text = "\n".join(toml_table(["svc"], values, {"i": "file"}))
    back = tomllib.loads(text)["svc"]
    assert back == {k: v for k, v in values.items() if v is not None}
    assert "# none is unset" in text and "i = -3  # file" in text
    assert math.isnan(tomllib.loads(f"x = {toml_value(math.nan)}")["x"])




@pytest.mark.slow
def test_run_and_dry_run_refuse_a_bad_service_value_alike_before_anything_starts(tmp_path):
    """`temper run --config bad.toml` as typed: the bad [learner] value is named before any process starts,
    in the same words as --dry-run."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nsteps = 3\n[model]\npreset = "tiny"\n[inference]\nengine = "hf"\n[learner]\nlr = "fast"\n')
    home = tmp_path / "home"
    runs = [subprocess.run([sys.executable, "-m", "temper.cli.main", "run", *extra, "--config", str(bad),
                            "--home", str(home)], capture_output=True, text=True, timeout=300)
            for extra in (["--dry-run"], [])]
    for p in runs:
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert "[learner] lr: Input should be a valid number" in p.stderr and "(got 'fast')" in p.stderr
    assert runs[0].stderr == runs[1].stderr
    assert not home.exists()  # no broker, no service, no model built


def test_dry_run_shows_what_each_domain_is_paid_and_the_detectors_policies(temper, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 2\ndomains = ["toy.copy", "rg.gcd"]\n[model]\npreset = "tiny"\n'
                   '[reward.domains.toy]\nweights = { "exact_answer.contains" = 1.0, exact_answer = 0.0 }\n'
                   '[monitor.detectors.reward_vs_gold]\ngold = "component.exact_answer"\npolicy = "pause"\n'
                   '[monitor.detectors.degeneration]\nenabled = false\n'
                   '[monitor.detectors.length.domains.rg]\npolicy = "stop"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert "reward    toy.copy: [reward.domains.toy] exact_answer.contains 1, exact_answer 0\n" in out
    assert "          rg.gcd: [reward.domains.rg] reasoning_gym 1" in out
    monitor = next(line for line in out.splitlines() if line.startswith("monitor   "))
    assert "reward_vs_gold pause," in monitor and "training_signal warn" in monitor
    assert "length warn on toy.copy/stop on rg.gcd" in monitor  # a per-domain policy, named per domain
    assert monitor.endswith("; off: degeneration")


def test_dry_run_pays_reasoning_gym_exact_and_refuses_a_misspelt_component(temper, tmp_path):
    """A job trains rg domains on the family's full credit only (reasoning_gym.exact); a misspelt component is
    refused before anything starts, naming the table."""
    job = tmp_path / "job.toml"
    body = '[job]\nsteps = 2\ndomains = ["rg.gcd"]\n[model]\npreset = "tiny"\n[reward.domains.rg]\nweights = { %s }\n'
    job.write_text(body % '"reasoning_gym.exact" = 1.0, reasoning_gym = 0.0')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert "reward    rg.gcd: [reward.domains.rg] reasoning_gym.exact 1, reasoning_gym 0\n" in out, out
    job.write_text(body % '"reasoning_gym.exakt" = 1.0')
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "domains.rg.weights" in err and "reasoning_gym.exakt" in err and "Traceback" not in err, err


def test_dry_run_shows_the_adapters_and_refuses_adapters_without_lora(temper, tmp_path):
    job = tmp_path / "job.toml"
    body = ('[job]\nsteps = 2\ndomains = ["toy.copy", "toy.next"]\n'
            '[job.adapters]\ncopying = ["toy.copy"]\ncounting = ["toy.next"]\n[model]\npreset = "tiny"\n')
    job.write_text(body + "[learner]\nlora_rank = 8\n")
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert "adapters  copying: toy.copy\n          counting: toy.next" in out
    job.write_text(body)
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "learner.lora_rank" in err, err
    job.write_text(body.replace('counting = ["toy.next"]', 'counting = ["toy.copy"]') + "[learner]\nlora_rank = 8\n")
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "adapters.counting" in err and "one adapter per domain" in err, err


def test_adapters_check_reads_the_ranks_services_will_start_with(temper, tmp_path, monkeypatch):
    """The learner's rank and the server's max_lora_rank as each service will read them: an environment variable
    (which every service inherits from the launcher) over the file, named in the error."""
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 2\ndomains = ["toy.copy", "toy.next"]\n'
                   '[job.adapters]\ncopying = ["toy.copy"]\ncounting = ["toy.next"]\n[model]\npreset = "tiny"\n')
    monkeypatch.setenv("TEMPER_LEARNER_LORA_RANK", "8")  # no [learner] lora_rank in the file
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    monkeypatch.setenv("TEMPER_INFERENCE_MAX_LORA_RANK", "4")
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "inference.max_lora_rank" in err and "env TEMPER_INFERENCE_MAX_LORA_RANK" in err, err
    monkeypatch.delenv("TEMPER_INFERENCE_MAX_LORA_RANK")
    monkeypatch.setenv("TEMPER_LEARNER_LORA_RANK", "eight")
    code, _, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 1 and "learner.lora_rank" in err and "env TEMPER_LEARNER_LORA_RANK" in err, err


def test_the_main_job_trains_on_full_credit_only(temper):
    """`make run`'s job pays reasoning-gym's full credit only (what held-out accuracy counts: the family's own scorer
    pays "10" half on a letter count of 1, which a policy farms); the partial credit stays on record at weight 0."""
    code, out, err = temper("run", "--dry-run", "--job", "smollm2")
    assert code == 0, err
    assert _plan_line(out, "reward") == ("rg.products, rg.lcm, rg.gcd: [reward.domains.rg] "
                                         "reasoning_gym.exact 1, reasoning_gym 0, format.answer_tag 0")


def test_the_plan_names_each_domains_most_common_answer(temper, tmp_path):
    """The dry run shows, per evaluated domain, the most common held-out answer and the share of problems it solves:
    a policy gains that much by giving it everywhere, without the skill. The main job keeps that share at most a
    third on every family (3-6-word letter counts, 60 % "1", were replaced by lcm, 6 % "40")."""
    code, out, err = temper("run", "--dry-run", "--job", "smollm2")
    assert code == 0, err
    line = next(line for line in out.splitlines() if "most common answer" in line)
    shares = dict(re.findall(r"(rg\.\w+) '[^']*' (\d+)%", line))
    assert shares == {"rg.products": "26", "rg.lcm": "6", "rg.gcd": "30"}, line
    job = tmp_path / "letters.toml"
    job.write_text('[job]\ndomains = ["rg.letter_counting"]\n[job.domain_config."rg.letter_counting"]\nmin_words = 3\n'
                   'max_words = 6\n[job.eval]\nsize = 50\n[model]\npreset = "tiny"\n')
    code, out, err = temper("run", "--dry-run", "--config", str(job))
    assert code == 0, err
    assert "most common answer (share of held-out problems it solves): rg.letter_counting '1' 60%" in out, out
