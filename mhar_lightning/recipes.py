"""Recipe files: a recipe names its base in a leading comment, `# base: <relative path>`, and holds only what
differs from it."""

import re
from pathlib import Path

import yaml

from mhar_lightning.errors import ConfigError

BASE_DIRECTIVE = re.compile(r"^#\s*base:\s*(\S+)\s*$")


def recipe_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[Path]:
    """`path` preceded by its bases: a recipe names its base in a leading comment `# base: <relative path>`."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"recipe {path} inherits from itself: fix the '# base:' line")
    for line in read_recipe(path).splitlines():
        if not line.startswith("#"):
            break
        if match := BASE_DIRECTIVE.match(line):
            base = path.parent / match.group(1)
            if not base.is_file():
                raise ConfigError(f"{path} names base {match.group(1)}, which does not exist: fix its '# base:' line")
            return [*recipe_chain(base, (*seen, path)), path]
    return [path]


def read_recipe(path: Path) -> str:
    """The text of config file `path`, refused in one line naming the file and line where it is not UTF-8 or not
    YAML (the parser would name neither)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({error.reason}): save the file as UTF-8") from None
    try:
        yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error, {error.problem or error.context}: fix that line") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error}): fix the file") from None
    return text
