"""Configuration documents: YAML files validated by pydantic, with command-line flags overriding file values.

Each component keeps its own settings beside its code (`store.config`, `codec.params`,
`publisher.config`, `subscriber.config`, `retention.policy`, each sink's module); this module
holds the settings every command shares and the loader. Unknown keys and bad values fail at
start with a ConfigError naming the key.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pulsesync.codec.params import CodecParams
from pulsesync.errors import ConfigError
from pulsesync.store.config import StoreConfig


class Config(BaseModel):
    """Settings every command shares; each daemon's config extends this."""

    model_config = ConfigDict(extra="forbid")

    store: StoreConfig = Field(default_factory=StoreConfig)
    codec: CodecParams = Field(default_factory=CodecParams)


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {part!r} must be a mapping to set {dotted}")
        node = child
    node[leaf] = value


def load_config(
    model: type[ConfigT], path: Path | str | None = None, overrides: dict[str, Any] | None = None
) -> ConfigT:
    """Load `model` from a YAML file (optional), then apply dotted-key overrides that are not None."""
    source = f"config file {path}" if path else "command line"
    tree: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path}: not UTF-8 text (a binary file?)") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: invalid YAML ({e})".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        tree = loaded or {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    return validate_config(model, tree, source)


def validate_config(model: type[ConfigT], tree: dict[str, Any], source: str) -> ConfigT:
    """`model` from a mapping (a YAML file's, or a framework's keyword arguments); ConfigError naming each bad key."""
    try:
        return model.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"{source}: " + "; ".join(_describe(model, err) for err in e.errors())) from None


def _describe(model: type[BaseModel], err: Any) -> str:
    """One validation error as `key: what is wrong`; a key that is no setting names the closest one."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc) or "(top level)"
    if err["type"] != "extra_forbidden":
        return f"{key}: {err['msg']}"
    fields: dict[str, Any] = model.model_fields
    for part in loc[:-1]:  # the settings of the section the key is in
        inner = fields.get(part)
        annotation = getattr(inner, "annotation", None)
        fields = annotation.model_fields if isinstance(annotation, type) and issubclass(annotation, BaseModel) else {}
    close = difflib.get_close_matches(loc[-1], list(fields), n=1)
    return f"{key}: not a setting" + (f" (did you mean {'.'.join([*loc[:-1], close[0]])}?)" if close else "")
