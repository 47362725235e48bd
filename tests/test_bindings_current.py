"""The checked-in bindings in microserving/v1 are exactly what scripts/gen_proto.sh makes."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_checked_in_bindings_match_regeneration(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    generated = sorted(p.name for p in (tmp_path / "microserving" / "v1").iterdir())
    checked_in = sorted(
        p.name for p in (ROOT / "microserving" / "v1").iterdir() if p.name.endswith((".py", ".pyi"))
        and p.name != "__init__.py"
    )
    assert generated == checked_in
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "microserving" / "v1", ROOT / "microserving" / "v1", generated, shallow=False
    )
    assert mismatch == [] and errors == [], f"regenerate with scripts/gen_proto.sh: {mismatch}"
