import pytest

import strata

PAGE = 4096


@pytest.fixture
def rt(tmp_path):
    """A small runtime with every kind of tier but CXL: a 16-page simulated
    device, a 64-page host tier and a 256-page NVMe file under tmp_path."""
    return strata.Runtime(
        device="sim",
        device_capacity=16 * PAGE,
        host_capacity=64 * PAGE,
        nvme_path=str(tmp_path),
        nvme_capacity=256 * PAGE,
        page_size=PAGE,
        background_eviction=False,
    )
