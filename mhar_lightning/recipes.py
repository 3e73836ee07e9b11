"""Recipe files: a recipe names its base in a leading comment, `# base: <relative path>`, and holds only what
differs from it."""

import re
from pathlib import Path

from mhar_lightning.errors import ConfigError

BASE_DIRECTIVE = re.compile(r"^#\s*base:\s*(\S+)\s*$")


def recipe_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[Path]:
    """`path` preceded by its bases: a recipe names its base in a leading comment `# base: <relative path>`."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"recipe {path} inherits from itself: fix the '# base:' line")
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if match := BASE_DIRECTIVE.match(line):
            base = path.parent / match.group(1)
            if not base.is_file():
                raise ConfigError(f"{path} names base {match.group(1)}, which does not exist: fix its '# base:' line")
            return [*recipe_chain(base, (*seen, path)), path]
    return [path]
