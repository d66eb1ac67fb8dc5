import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("SHARDCAST_BUILD_DIR", ROOT / "build"))
    if not (d / "tools" / "shardcast").exists():
        pytest.fail(f"no shardcast build in {d}; run tools/build.sh or set SHARDCAST_BUILD_DIR")
    return d


@pytest.fixture(scope="session")
def shardcast_bin(build_dir) -> pathlib.Path:
    return build_dir / "tools" / "shardcast"
