"""The service's configuration (service/config.py ``ServiceConfig``): a default answer longer than
the limit is refused, and the default data directory is absolute."""

from __future__ import annotations

import pytest

from kvsnap.errors import InvalidArgument
from kvsnap.service.config import ServiceConfig


def test_config_refuses_a_default_answer_longer_than_the_limit():
    with pytest.raises(InvalidArgument, match="default_max_tokens"):
        ServiceConfig.from_env(max_new_tokens=64, default_max_tokens=128)


def test_the_default_data_dir_is_absolute_under_the_working_directory(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSNAP_DATA_DIR", raising=False)
    for cfg in (ServiceConfig(), ServiceConfig.from_env(), ServiceConfig(data_dir="rel")):
        assert os.path.isabs(cfg.data_dir) and cfg.data_dir.startswith(str(tmp_path)), cfg.data_dir
        assert ServiceConfig(**cfg.model_dump()).data_dir == cfg.data_dir  # what a replica rebuilds
