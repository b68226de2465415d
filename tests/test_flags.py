"""Flags people do not trip on: real argv through the real parser, and the help they read."""

import re

import pytest

from specdec.api import GenerationParams
from specdec.cli import _method_opts, build_parser
from specdec.drafters import registry
from specdec.options import flag_values, unescape
from specdec.training.config import LoopConfig
from specdec.training.loop import lr_lambda, warmup_steps
from specdec.training.train_cli import config_of


def parse(*argv):
    return build_parser().parse_args(list(argv))


def error_of(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---- the tree's top-k is --tree-topk; --topk still works, with a note ----

def test_tree_topk_is_its_own_flag_beside_samplings_top_k(capsys):
    args = parse("generate", "hi", "--method", "eagle2", "--tree-topk", "3", "--top-k", "5")
    assert _method_opts(args) == {"topk": "3"}
    assert registry.parse("eagle2", _method_opts(args))[1].topk == 3
    assert GenerationParams.parse(flag_values(args, GenerationParams)).top_k == 5
    assert capsys.readouterr().err == ""


def test_the_old_topk_spelling_works_with_a_one_line_note(capsys):
    args = parse("generate", "hi", "--method", "sps-tree", "--topk", "2")
    assert registry.parse("sps-tree", _method_opts(args))[1].topk == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--topk is deprecated" in err and "--tree-topk" in err


def test_help_names_tree_topk_and_hides_the_old_spelling(capsys):
    text = help_of(capsys, "generate")
    assert "--tree-topk N" in text and "--topk" not in text and "--top-k N" in text


# ---- a boolean flag alone means true; true/false still work ----

@pytest.mark.parametrize("argv,want", [
    (["--typical"], True), (["--typical", "true"], True), (["--typical", "false"], False),
    (["--typical", "0"], False), ([], False),
])
def test_a_bare_boolean_flag_means_true(argv, want):
    args = parse("generate", "hi", "--method", "medusa", *argv)
    assert registry.parse("medusa", _method_opts(args))[1].typical is want


def test_a_bare_switch_before_the_prompt_is_still_true():
    args = parse("generate", "--adaptive", "--tree-topk", "2", "hello")
    assert (args.prompt, _method_opts(args)) == ("hello", {"adaptive": "true", "topk": "2"})


def test_a_word_after_a_boolean_flag_says_what_the_flag_takes(capsys):
    err = error_of(capsys, "generate", "--typical", "hello")
    assert "--typical" in err and "true or false" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,want", [
    ([], False), (["--freeze-lm-head"], True), (["--freeze-lm-head", "true"], True),
    (["--freeze-lm-head", "false"], False),
])
def test_training_switches_take_a_value_or_none(argv, want):
    from specdec.training.train import TrainConfig

    args = parse("train", "eagle", "--data", "d", "--out", "o", *argv)
    assert config_of(args, TrainConfig).freeze_lm_head is want


def test_training_switch_with_a_bad_word_is_one_line(capsys):
    err = error_of(capsys, "train", "eagle", "--data", "d", "--out", "o", "--pad", "maybe")
    assert err.startswith("specdec: error:") and err.count("\n") == 1 and "--pad" in err


# ---- stop strings: backslash escapes are interpreted on the command line ----

@pytest.mark.parametrize("typed,want", [
    (r"\n", "\n"), (r"\n\n", "\n\n"), (r"END\t", "END\t"), (r"a\\n", "a\\n"), ("é\\n", "é\n"),
    ("日本", "日本"), (r"\u00e9", "é"), ("plain", "plain"),
])
def test_stop_strings_interpret_backslash_escapes(typed, want):
    args = parse("generate", "hi", "--stop", typed, "--stop", "###")
    assert GenerationParams.parse(flag_values(args, GenerationParams)).stop == [want, "###"]
    assert unescape(typed) == want


def test_a_broken_escape_is_one_clear_error(capsys):
    err = error_of(capsys, "generate", "hi", "--stop", "\\x4")
    assert "--stop" in err and "escape" in err


def test_stop_help_says_escapes_are_interpreted(capsys):
    assert re.search(r"--stop TEXT\s.*backslash\s+escapes", help_of(capsys, "generate"), re.S)


# ---- help: every default once, meaningful metavars, every training flag explained ----

COMMANDS = [("generate",), ("datagen",), ("train", "eagle"), ("train", "fspad"), ("train", "medusa"), ("tune",)]


def help_of(capsys, *command) -> str:
    with pytest.raises(SystemExit):
        parse(*command, "-h")
    return capsys.readouterr().out


def option_blocks(text: str) -> dict[str, str]:
    """flag -> its help text, from argparse's "options:" section."""
    blocks, flag = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"^  (-[-\w]+)(.*)", line)
        if m:
            flag = m.group(1)
            blocks[flag] = m.group(2)
        elif flag:
            blocks[flag] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_gives_each_default_once_and_no_bare_v_metavar(command, capsys):
    text = help_of(capsys, *command)
    assert not re.search(r"--[\w-]+ V\b", text), text
    blocks = option_blocks(text)
    assert len(blocks) > 3
    for flag, block in blocks.items():
        assert len(re.findall(r"\bdefault\b", block, re.I)) <= 1, (flag, block)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c[0] in ("datagen", "train", "tune")], ids=" ".join)
def test_every_training_flag_has_help_and_its_default(command, capsys):
    for flag, block in option_blocks(help_of(capsys, *command)).items():
        if flag in ("-h", "--data", "--out", "--shards"):  # required: no default to show
            continue
        words = block.split(None, 1)
        assert len(words) > 1 and len(words[1]) > 10, (flag, block)  # a help text, not just a metavar
        assert re.search(r"\bdefault\b", block, re.I), (flag, block)


def test_metavars_say_what_a_value_is(capsys):
    text = help_of(capsys, "generate")
    for shown in ("--max-new-tokens N", "--temperature X", "--head PATH", "--rank-by {value,confidence}",
                  "--typical [{true,false}]", "--choices JSON"):
        assert shown in text, shown
    assert "--pad [{true,false}]" in help_of(capsys, "train", "eagle")


def test_training_defaults_follow_the_documented_recipe():
    from specdec.training.medusa import MedusaTrainConfig
    from specdec.training.train import TrainConfig

    eagle = config_of(parse("train", "eagle", "--data", "d", "--out", "o"), TrainConfig)
    assert (eagle.lr, eagle.batch_size, eagle.warmup, eagle.epochs) == (1e-3, 8, 50, 3.0)
    assert eagle == TrainConfig(data="d", out="o")
    medusa = config_of(parse("train", "medusa", "--data", "d", "--out", "o"), MedusaTrainConfig)
    assert (medusa.lr, medusa.batch_size, medusa.warmup, medusa.clip) == (1e-3, 8, 20, 1.0)
    assert medusa == MedusaTrainConfig(data="d", out="o")
    gen = parse("datagen", "--out", "o", "--shards", "1")
    assert (gen.batch_size, gen.sources, gen.shard_size) == (64, ["self", "gsm8k"], 64)


# ---- a warmup as long as the run is cut, with a note ----

def test_a_warmup_longer_than_the_run_is_cut_so_the_lr_reaches_its_peak():
    cfg = LoopConfig(data="d", out="o", warmup=100, steps=3)
    assert warmup_steps(cfg, 3) == 0
    f = lr_lambda(cfg, 3)
    assert f(0) == 1.0 and f(2) < 1.0  # at the peak from the start, then the cosine decay
    long = LoopConfig(data="d", out="o", warmup=100, steps=50)
    assert warmup_steps(long, 50) == 5 and lr_lambda(long, 50)(5) == 1.0
    kept = LoopConfig(data="d", out="o", warmup=10, steps=300)
    assert warmup_steps(kept, 300) == 10 and lr_lambda(kept, 300)(0) == pytest.approx(1 / 11)


# ---- training configs: resume keys marked on the fields, errors named by flag ----

def test_resume_keys_are_the_fields_marked_so():
    from specdec.training.medusa import MedusaTrainConfig
    from specdec.training.train import TrainConfig

    for cls in (TrainConfig, MedusaTrainConfig):
        keys = set(cls.resume_keys())
        assert {"data", "steps", "lr", "schedule", "seed", "init_from", "draft_vocab"} <= keys
        assert not {"out", "save_every", "keep_checkpoints", "log_every", "stop_after", "ship_to"} & keys
    assert {"connector", "pad", "arch", "unroll", "freeze_lm_head"} <= set(TrainConfig.resume_keys())
    medusa = set(MedusaTrainConfig.resume_keys())
    assert {"joint", "num_heads", "lora_layers"} <= medusa and "keep_activations" not in medusa


def test_a_trainers_own_recipe_keeps_the_shared_field_and_errors_name_the_flag():
    from specdec.errors import SpecdecError
    from specdec.training.medusa import MedusaTrainConfig
    from specdec.training.train import TrainConfig

    assert TrainConfig(data="d", out="o", max_len=2).max_len == 2
    with pytest.raises(SpecdecError, match=r"^--max-len must be an integer >= 3, got 2$"):
        MedusaTrainConfig(data="d", out="o", max_len=2)
    with pytest.raises(SpecdecError, match=r"^--lr must be a finite number >= 0, got -1.0$"):
        MedusaTrainConfig(data="d", out="o", lr=-1.0)
    with pytest.raises(SpecdecError, match="^--out must be given$"):
        TrainConfig(data="d")
    assert (LoopConfig.model_fields["lr"].default, MedusaTrainConfig(data="d", out="o").lr) == (3e-4, 1e-3)
