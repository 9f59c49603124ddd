"""One config per policy method: the topology's ``loss.policy`` is the config its ``name`` picks, and a
field that method does not read is refused at check time (exit 2), naming the method's own fields."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from losses.config import POLICIES, LossConfig, policy_config, policy_fields
from mesh.run import main
from mesh.topology.schema import TopologyError, load_topology

TOPOLOGIES = Path(__file__).resolve().parents[1] / "topologies"
TINY = TOPOLOGIES / "tiny.yaml"
POLICY = "actors.trainer.loss.policy"

# The flat PolicyConfig before issue 29: one record for every method, None meaning the method's
# published (clip_low, clip_high, aggregation), and group_std unless the method is mean-centred.
OLD_FLAT = dict(
    dual_clip=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
    cov_fraction=2e-4,
    clip_cov_low=1.0,
    clip_cov_high=5.0,
    kl_cov_coef=1.0,
    entropy_coef=0.0,
    kl_coef=0.0,
    kl_unbiased=False,
    cispo_max_ratio=5.0,
    dppo_mask_low=0.2,
    dppo_mask_high=0.2,
    dppo_adv_tau=1.0,
    dppo_kl_tau=1e-3,
    is_mode=None,
    is_min=0.0,
    is_max=2.0,
)
OLD_PUBLISHED = {
    "grpo": (0.2, 0.2, "seq_mean_token_mean"),
    "dr_grpo": (0.2, 0.2, "constant"),
    "dapo": (0.2, 0.28, "token_mean"),
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean"),
    "gspo_token": (3e-4, 4e-4, "seq_mean_token_mean"),
    "cispo": (None, None, "token_mean"),
    "dppo": (None, None, "token_mean"),
    "sapo": (None, None, "seq_mean_token_mean"),
    "clip_cov": (0.2, 0.2, "token_mean"),
    "kl_cov": (None, None, "token_mean"),
}
COMMON = {"name", "aggregation", "advantage", "entropy_coef", "kl_coef", "kl_unbiased", "is_mode", "is_min", "is_max"}
CLIP = {"clip_low", "clip_high", "dual_clip"}
# The fields losses/policy.py reads for each method, beyond the common ones.
OWN = {
    "grpo": CLIP,
    "dr_grpo": CLIP,
    "dapo": CLIP,
    "gspo": CLIP,
    "gspo_token": CLIP,
    "cispo": {"cispo_max_ratio"},
    "dppo": {"dppo_mask_low", "dppo_mask_high", "dppo_adv_tau", "dppo_kl_tau"},
    "sapo": {"sapo_tau_pos", "sapo_tau_neg"},
    "clip_cov": CLIP | {"cov_fraction", "clip_cov_low", "clip_cov_high"},
    "kl_cov": {"cov_fraction", "kl_cov_coef"},
}


def old_defaults(name: str) -> dict:
    low, high, aggregation = OLD_PUBLISHED[name]
    advantage = "group_mean" if name in ("dr_grpo", "dppo") else "group_std"
    return OLD_FLAT | dict(name=name, clip_low=low, clip_high=high, aggregation=aggregation, advantage=advantage)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_each_method_has_its_own_fields_with_the_old_flat_defaults(name):
    assert set(policy_fields(name)) == OWN[name] | COMMON - ({"kl_coef", "kl_unbiased"} if name == "dppo" else set())
    defaults = dataclasses.asdict(policy_config(name))
    assert defaults == {key: old_defaults(name)[key] for key in defaults}
    assert POLICIES[name]() == policy_config(name)
    assert (POLICIES[name]().kl_coef, POLICIES[name]().kl_unbiased) == (0.0, False)  # DPPO's too: no reference


def test_the_default_method_is_unchanged():
    unnamed = load_topology(TINY, [f"{POLICY}={{}}"]).actors.trainer.loss.policy
    assert LossConfig().policy == policy_config("dapo") == unnamed


@pytest.mark.parametrize(
    "name, key, hint",
    [
        ("dapo", "sapo_tau_pos", "set name to a method that reads it: sapo"),
        ("grpo", "cov_fraction", "clip_cov, kl_cov"),
        ("cispo", "clip_low", "'cispo' does not clip the ratio; set cispo_max_ratio instead"),
        ("dppo", "kl_coef", "'dppo' has its own KL term, dppo_kl_tau"),
        ("sapo", "dual_clip", "set sapo_tau_pos/neg instead"),
    ],
)
def test_a_field_of_another_method_is_refused_naming_the_methods_fields(name, key, hint, capsys):
    fields = ", ".join(policy_fields(name))
    with pytest.raises(ValueError) as built:
        policy_config(name, **{key: 0.5})
    overrides = [f"{POLICY}.name={name}", f"{POLICY}.{key}=0.5"]
    with pytest.raises(TopologyError) as loaded:
        load_topology(TINY, overrides)
    for message in (str(built.value), str(loaded.value)):
        assert f"{key} does not apply to policy loss {name!r}" in message, message
        assert f"the fields of {name!r} are: {fields}." in message and hint in message, message
    assert f"{TINY}: {POLICY}: {key} does not apply" in str(loaded.value)
    assert main([str(TINY), "--dry-run", *(f"--set={override}" for override in overrides)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {TINY}: {POLICY}: ") and error.count("\n") == 1 and "Traceback" not in error


def test_an_unknown_name_or_key_lists_what_there_is():
    with pytest.raises(TopologyError, match=f"{POLICY}: unknown policy loss 'ppo'; choose one of grpo, dr_grpo, dapo"):
        load_topology(TINY, [f"{POLICY}.name=ppo"])
    with pytest.raises(TopologyError) as typo:
        load_topology(TINY, [f"{POLICY}.clip_hihg=0.3"])
    assert "unknown key 'clip_hihg' (no policy loss has it)" in str(typo.value)
    assert f"the fields of 'dapo' are: {', '.join(policy_fields('dapo'))}. Fix the spelling" in str(typo.value)
    with pytest.raises(ValueError, match="DAPOPolicyConfig is policy loss 'dapo', not 'grpo'"):
        POLICIES["dapo"](name="grpo")


@pytest.mark.parametrize(
    "override, expected",
    [
        (f"{POLICY}={{name: kl_cov, kl_cov_coef: -1}}", f"{POLICY}: kl_cov_coef must be >= 0"),
        (f"{POLICY}={{name: gspo, clip_high: .inf}}", f"{POLICY}.clip_high: Input should be a finite number"),
        (f"{POLICY}={{name: sapo, sapo_tau_neg: cold}}", f"{POLICY}.sapo_tau_neg: Input should be a valid number"),
    ],
)
def test_a_methods_own_errors_name_the_key_path_without_the_union_member(override, expected):
    with pytest.raises(TopologyError, match=expected):
        load_topology(TINY, [override])


@pytest.mark.parametrize("path", sorted(TOPOLOGIES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_topology_loads_its_method_with_its_defaults(path):
    given = yaml.safe_load(path.read_text())["actors"]["trainer"]["loss"]["policy"]
    policy = load_topology(path, placed_here=not path.name.startswith("gpu")).actors.trainer.loss.policy
    assert type(policy) is POLICIES[policy.name] and policy == policy_config(**given)
