"""What a mistyped configuration is told, in Python and on the command line: a misspelt Config field gets the
field meant (as a configuration file's key does), a device name no device has is refused when the Config is made,
and a negative size is a value its flag refuses, not an unknown option."""
import pytest

from twophase.config import Config
from twophase.train import cli


def test_a_misspelt_field_gets_the_one_meant():
    with pytest.raises(TypeError, match=r"^Config got an unexpected keyword argument 'beam_sise' \(did you mean "
                                        r"beam_size\?\)$"):
        Config(beam_sise=4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):  # nothing close: no hint
        Config(zzz=1)


def test_the_same_hint_as_a_configuration_file_s_key(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("beam_sise: 4\n")
    assert cli.main(["--config", str(tmp_path / "c.yaml")]) == 2
    assert "beam_sise: unknown key (did you mean beam_size?)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpu0", "cuda:x", "CPU", ""])
def test_a_device_name_no_device_has_is_refused_when_the_config_is_made(name, capsys):
    with pytest.raises(ValueError, match=f"^Config.device: expected cpu, cuda, cuda:N, mps or auto, got '{name}'$"):
        Config(device=name)
    with pytest.raises(SystemExit):
        cli.parse(["--device", name])
    err = capsys.readouterr().err
    assert err.strip() == f"train.py: error: argument --device: expected cpu, cuda, cuda:N, mps or auto, got '{name}'"
    for good in ("cpu", "cuda", "cuda:1", "mps", "auto"):
        assert Config(device=good).device == good  # whether the machine has it is asked where the run starts


@pytest.mark.parametrize("text", ["-1GB", "-512MiB", "-2"])
def test_a_negative_memory_budget_is_its_flag_s_refusal(text, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse(["--rescore-chunk", "auto", "--memory-budget", text])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"train.py: error: argument --memory-budget: expected a size such as 2GiB or 512MB, got '{text}'"
    with pytest.raises(ValueError, match="Config.memory_budget: expected a size such as 2GiB"):
        Config(rescore_chunk="auto", memory_budget=text)
