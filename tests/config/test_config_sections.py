"""The sectioned configuration: the flat Config's record is unchanged (its keys and their order are what every
checkpoint and config.json hold), each section is a view of it, --help prints the sections as groups with each
field's help, the "applies to X only" refusals come from the sections' declared conditions with the same lines."""
import dataclasses

import pytest

from twophase.train import cli
from twophase import config
from twophase.config import rules
from twophase.config import rules as configrules
from twophase.config import SECTIONS, Config

# asdict(Config()) as train.py wrote it into every checkpoint before the flat Config was written out as the
# sections joined: frozen here, so a renaming or a removal shows as a failure (the record is read by name, so its
# order may change: it is now the sections' order)
FROZEN_KEYS = (
    "preset task train valid test char_source char_target lowercase_source max_src_len too_long valid_size "
    "train_size hf_model embed_dim hidden_size bidirectional dropout karel_model karel_channels karel_blocks "
    "karel_pair_dim karel_layers mle_steps mle_batch_size lr lr_decay patience min_lr rl_steps batch_size rl_lr "
    "sampler beam_size temperature objective baseline loss_type importance_sampling_level delta "
    "sapo_temperature_pos sapo_temperature_neg off_policy_mask_threshold entropy_coef top_entropy_quantile "
    "use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target "
    "mask_truncated_completions updates_per_generation clip_epsilon clip_epsilon_high kl_beta "
    "kl_importance_weighted ref_checkpoint advantage_scale drop_zero_std mrt_alpha compare_mle mle_weight reward "
    "max_len grammar rescore_chunk memory_budget profile_memory reward_weights top_k "
    "top_p min_len lora_r lora_alpha lora_dropout lora_target_modules merge_lora rl_from_best include_reference "
    "karel_reward_pairs test_beam clip_norm eval_every eval_beam best_metric tensorboard picture log_every seed "
    "device deterministic tf32 save_dir save_every keep_last resume overwrite max_bad_steps threads resume_from "
    "init_from eval_only export grad_accum fsdp amp compile teacher distill_beta target_vocab").split()
FROZEN_DEFAULTS = dict(hidden_size=256, embed_dim=64, beam_size=8, rescore_chunk=128, eval_beam=5, mrt_alpha=0.5,
                       objective="beam", loss_type="dapo", sapo_temperature_neg=1.05, picture=True, compile="off")


def test_the_flat_record_keeps_its_keys_in_the_sections_order():
    record = dataclasses.asdict(Config())
    assert list(record) == [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert set(FROZEN_KEYS) <= set(record)  # every key a checkpoint of today's code holds
    old = {k: record[k] for k in FROZEN_KEYS}  # a record in the order checkpoints stored it until now
    assert config.config_from_dict({**old, "lr_decay": 0.5}) == Config(lr_decay=0.5)
    assert {k: record[k] for k in FROZEN_DEFAULTS} == FROZEN_DEFAULTS
    cfg = Config(train="t.tsv", valid="v.tsv", char_source=True, hidden_size=32)  # flat keywords and attributes
    assert (cfg.train, cfg.char_source, cfg.hidden_size, cfg.beam_size) == ("t.tsv", True, 32, 8)


def test_every_field_lives_in_exactly_one_section_and_carries_its_help():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert set(FROZEN_KEYS) <= set(names) and len(names) == len(set(names))
    for cls in SECTIONS.values():
        assert cls.__doc__ and cls.title
        for f in dataclasses.fields(cls):
            assert f.metadata["help"], f.name
            assert not f.metadata["help"].startswith("--"), f"{f.name}: the section names the condition"
            assert not f.metadata["help"].startswith("with --"), f.name


def test_a_section_view_holds_the_configs_values():
    cfg = Config(beam_size=3, sampler="sample", objective="policy", loss_type="grpo", hidden_size=16)
    assert isinstance(cfg.search, config.SearchConfig)
    assert (cfg.search.beam_size, cfg.search.sampler) == (3, "sample")
    assert cfg.section("policy") == config.PolicyConfig(loss_type="grpo")
    assert cfg.model.hidden_size == 16 and cfg.section("model") == cfg.model
    joined = {}
    for name in SECTIONS:
        joined.update(dataclasses.asdict(cfg.section(name)))
    assert joined == dataclasses.asdict(cfg)


def test_help_prints_the_sections_as_groups_with_the_tasks_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--task", "karel", "--help", "all"])
    text = capsys.readouterr().out
    titles = list(SECTIONS)  # the groups are titled by the sections' keys in a configuration file
    assert len(titles) >= 5
    for title in titles:
        assert f"\n{title}:\n" in text, title
    assert text.index("\nsearch:\n") < text.index("  --beam-size") < text.index("\nrl:\n")
    flat = " ".join(text.split())
    assert "Applies with --objective policy only." in flat and "Applies with --lora-r only." in flat
    assert "the soft gate's temperature of --loss-type sapo elsewhere (default: 1.05)" in flat
    assert "LSTM hidden size of encoder and decoder (default: 128)" in flat  # Karel's recipe, not 256
    assert "--task karel's own defaults" in flat
    parser = cli.build_parser()
    grouped = {a.dest for g in parser._action_groups if g.title in titles for a in g._group_actions}
    assert grouped == set(config.ORDER)


# (the Config, the one line today's checks raised), each from the checks before its checks were declared
REFUSALS = [
    (dict(task="tsv", train="t", valid="v", karel_reward_pairs="shown"),
     "--karel-reward-pairs applies to --task karel only"),
    (dict(memory_budget="2GiB"), "--memory-budget applies to --rescore-chunk auto only, not --rescore-chunk 128"),
    (dict(lora_dropout=0.1), "--lora-dropout needs --lora-r"),
    (dict(merge_lora=True, lora_alpha=2.0), "--lora-alpha needs --lora-r"),
    (dict(lora_r=4), "--lora-r adapts a Hugging Face model: it needs --hf-model"),
    (dict(train="t", valid="v", hf_model="m", hidden_size=16),
     "--hf-model: --hidden-size sets the built-in LSTM; a Hugging Face model's size and dropout are its config's "
     "(dropout applies to its MLE steps)"),
    (dict(train="t", valid="v", hf_model="m", char_target=True),
     "--hf-model: --char-target splits text for the built-in vocabularies; the model's tokenizer splits it"),
    (dict(kl_beta=0.1), "--kl-beta applies to --objective policy only, not --objective beam"),
    (dict(objective="mrt", clip_epsilon=0.1, entropy_coef=0.1),
     "--clip-epsilon applies to --objective policy only, not --objective mrt"),
    (dict(objective="policy", sapo_temperature_neg=2.0),
     "--sapo-temperature-neg applies to --loss-type sapo only, not dapo"),
    (dict(objective="policy", entropy_target=0.5), "--entropy-target applies with --use-adaptive-entropy only"),
    (dict(include_reference=True, objective="mrt"),
     "--include-reference applies to --objective beam or distill only, not --objective mrt"),
    (dict(temperature=0.5), "--temperature applies to --sampler sample only, not --sampler beam"),
    (dict(mrt_alpha=0.2), "--mrt-alpha applies to --objective mrt only, not --objective beam"),
]


@pytest.mark.parametrize("values, line", REFUSALS)
def test_a_field_outside_its_condition_is_refused_with_todays_line(values, line):
    with pytest.raises(ValueError) as info:
        Config(**values).validate()
    assert str(info.value) == line


def test_what_the_conditions_allow_still_passes():
    Config(objective="policy", rl_steps=0, kl_beta=0.1).validate()
    Config(kl_beta=0.1, rl_steps=0).validate()  # no RL steps: the RL flags are never read, nothing refused
    Config(objective="policy", loss_type="sapo", sapo_temperature_neg=2.0).validate()
    Config(rescore_chunk="auto", memory_budget="2GiB").validate()
    Config(objective="policy", mrt_alpha=0.2).validate()  # as before: --mrt-alpha is checked for the others


def test_the_resume_rules_are_the_fields_declarations():
    declared = {f.name: f.metadata["resume"] for f in dataclasses.fields(Config)}
    assert rules.RULES == {k: v for k, v in declared.items() if v != rules.FIXED}
    assert rules.RULES["rl_steps"] == rules.GROW and rules.RULES["mle_steps"] == \
        rules.PHASE
    assert set(rules.NOT_INHERITED) == {"save_dir", "device", "resume", "resume_from", "overwrite",
                                               "eval_only", "fsdp", "compile"}
    assert configrules.section_fields("lora")[0] == "lora_r"


def test_a_task_receives_its_own_settings_only(monkeypatch):
    from twophase import tasks
    seen = []

    class Probe(tasks.Task):
        def __init__(self, settings):
            super().__init__()
            seen.append(settings)

    monkeypatch.setattr(tasks, "get", lambda name: Probe)
    tasks.build(Config(beam_size=3, max_len=9, lora_r=2, hf_model="m", train="t", valid="v"), "probe")
    [settings] = seen
    assert isinstance(settings, config.TaskConfig)
    assert (settings.hidden_size, settings.max_len, settings.lora_r, settings.train) == (256, 9, 2, "t")
    with pytest.raises(config.NotATaskSetting, match="beam_size .*the search section's"):
        settings.beam_size  # the trainer's, not the task's
    with pytest.raises(config.NotATaskSetting, match="seed"):
        getattr(settings, "seed", 0)  # never a silent default for a setting that exists but is not the task's
    assert getattr(settings, "no_such_setting", 0) == 0  # what is no setting at all is an ordinary attribute
    names = set(settings.__dataclass_fields__)
    assert names == {n for s in ("data", "model", "karel", "countdown", "lora") for n in config.section_fields(s)} | {"max_len"}


def test_a_task_reading_a_trainer_setting_is_one_line_naming_it(monkeypatch):
    from twophase import tasks

    class Greedy(tasks.Task):
        def __init__(self, settings):
            super().__init__()
            self.seed = getattr(settings, "seed", 0)

    monkeypatch.setattr(tasks, "get", lambda name: Greedy)
    with pytest.raises(tasks.TaskError, match="task 'greedy' raised .*TaskConfig has no seed"):
        tasks.build(Config(), "greedy")


def test_the_shaping_flags_are_the_data_model_and_task_sections():
    # the fields of the data and model sections but --task and --valid-size, and the built-in tasks' own sections
    # (another task refuses them: a Karel or Countdown flag with --task g2p would do nothing)
    assert config.SHAPING_FLAGS == {"train", "valid", "test", "char_source", "char_target", "lowercase_source",
                                    "max_src_len", "too_long", "target_vocab", "train_size", "hf_model", "embed_dim",
                                    "hidden_size",
                                    "bidirectional", "dropout",
                                    "karel_model", "karel_channels", "karel_blocks", "karel_pair_dim", "karel_layers",
                                    "karel_reward_pairs", "countdown_numbers", "countdown_max",
                                    "countdown_target_min", "countdown_target_max", "countdown_hidden"}
