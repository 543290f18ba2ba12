"""The run configuration: the schema (`schema`), reading YAML and overrides (`parse`, `load`) and
the checks that need nothing but the config (`validate`, `limits`).

This package imports nothing else of leantune but `leantune.errors`: every other layer reads it.
The checks that need a registry (methods, objectives, templates, monitoring backends) belong to
their owners and run with these in `training.checks.load_config`.
"""

from leantune.config.load import (
    config_base,
    describe_base,
    dump_config,
    parse_override,
    read_config,
    set_field,
    to_dict,
)
from leantune.config.parse import ConfigError
from leantune.config.schema import (
    AUTO_RUN_NAME,
    DEFAULT_BATCH_EXAMPLES,
    DEMO_CONFIG,
    Config,
    DataConfig,
    GuardConfig,
    MethodConfig,
    ModelConfig,
    RopeScalingConfig,
    RunConfig,
    TrainConfig,
    field_docs,
    field_roles,
    refused_reasons,
)
from leantune.config.validate import (
    COMPILE_ONE_PROCESS,
    RUN_NAME_MAX,
    configured_global_batch,
    parse_memory_size,
    validate,
)

__all__ = [
    "AUTO_RUN_NAME",
    "COMPILE_ONE_PROCESS",
    "DEFAULT_BATCH_EXAMPLES",
    "DEMO_CONFIG",
    "RUN_NAME_MAX",
    "Config",
    "ConfigError",
    "DataConfig",
    "GuardConfig",
    "MethodConfig",
    "ModelConfig",
    "RopeScalingConfig",
    "RunConfig",
    "TrainConfig",
    "config_base",
    "configured_global_batch",
    "describe_base",
    "dump_config",
    "field_docs",
    "field_roles",
    "parse_memory_size",
    "parse_override",
    "read_config",
    "refused_reasons",
    "set_field",
    "to_dict",
    "validate",
]
