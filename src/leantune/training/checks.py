"""Every check of a config before anything loads: the config's own (`config.validate`) and its
registries' owners' (a method's, an objective's, a chat template's, a monitoring backend's).

`load_config` is what the CLI, the API and the recipe call: nothing runs on a config that has
not passed all of them.
"""

from __future__ import annotations

from pathlib import Path

from leantune.config import Config, read_config, validate
from leantune.data.templates import template_text
from leantune.methods.checks import check_method
from leantune.methods.registry import METHODS
from leantune.monitor.backends import check_packages
from leantune.objectives.checks import check_objective, check_preference, check_reference


def check_config(cfg: Config) -> list[str]:
    """Raise ConfigError (naming the field and the fix) for an invalid config; return warnings
    for risky settings."""
    return validate(cfg) + _owners_checks(cfg)


def _owners_checks(cfg: Config) -> list[str]:
    """The checks that need a registry: a template's, the monitoring backends', the method's and
    the objective's."""
    warnings: list[str] = []
    if cfg.data.chat_template is not None:
        template_text(cfg.data.chat_template)  # a ChatTemplateError names the field and file
    check_packages(cfg.monitor)
    warnings += check_method(cfg)
    t, spec = cfg.train, METHODS[cfg.method.name]
    warnings += check_preference(cfg.preference, t.objective, t.kl_coef)
    check_objective(
        t.objective,
        cfg.data.format,
        cfg.method.name,
        needs_unpacked_data=spec.needs_unpacked_data,
        eval_exact_match=t.eval_exact_match,
    )
    warnings += check_reference(t.reference, t.objective, cfg.method.name, spec.trains_base_weights)
    return warnings


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """A Config from a YAML file and `section.field=value` overrides, with every check passed.

    Raises:
        ConfigError: unknown keys, wrong types or invalid combinations, naming the field.
    """
    cfg = read_config(path, overrides)  # `config.validate` has run on it
    _owners_checks(cfg)
    return cfg
