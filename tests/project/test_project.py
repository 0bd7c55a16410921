"""The conda environment stays consistent with pyproject.toml."""

import re
from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    conda = {re.split(r"[<>=!\s]", d, maxsplit=1)[0]: d for d in deps if isinstance(d, str)}
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    torch_req = next(r for r in project["dependencies"] if re.match(r"torch\b", r))
    assert conda["pytorch"].replace("pytorch", "") == torch_req.replace("torch", "")
    assert conda["python"].replace("python", "") == project["requires-python"]
    assert "pip" in conda
    assert pip == ["-e .[notebook]"] and "notebook" in project["optional-dependencies"]
    assert project["scripts"]["kvexplore"] == "kvexplore.cli:main"
