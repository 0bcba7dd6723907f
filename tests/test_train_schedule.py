"""Learning-rate schedules: the noam formula, cosine endpoints, warmup, and LambdaLR wiring."""

import math

import pytest
import torch

from blockformer.run_config import TrainConfig
from blockformer.train.schedule import build_scheduler, constant, cosine, noam


@pytest.mark.parametrize("step", [1, 100, 3999, 4000, 4001, 10000, 100000])
def test_noam_equals_the_papers_formula(step):
    expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
    assert noam(step, d_model=512, warmup=4000) == pytest.approx(expected, rel=1e-12)


def test_noam_peaks_at_warmup_with_the_known_value():
    values = [noam(s, d_model=512, warmup=4000) for s in range(1, 20001)]
    assert max(values) == values[3999]  # step 4000
    assert values[3999] == pytest.approx(6.9877e-4, rel=1e-4)  # 512^-0.5 * 4000^-0.5
    assert noam(16000, d_model=512, warmup=4000) == pytest.approx(values[3999] / 2, rel=1e-12)


def test_cosine_endpoints_and_midpoint():
    kw = dict(warmup=10, total=110, floor=0.1)
    assert cosine(0, **kw) == pytest.approx(1 / 11)
    assert cosine(9, **kw) == pytest.approx(10 / 11)
    assert cosine(10, **kw) == pytest.approx(1.0)
    assert cosine(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: the mean of 1 and floor
    assert cosine(110, **kw) == pytest.approx(0.1)
    assert cosine(500, **kw) == pytest.approx(0.1)


def test_constant_warms_up_then_holds():
    assert [constant(i, warmup=3) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert constant(0, warmup=0) == 1.0


def _lrs(cfg: TrainConfig, d_model: int, n: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, d_model)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scheduler_gives_the_noam_rate_of_step_i_plus_one_to_update_i():
    cfg = TrainConfig(schedule="noam", warmup=4, lr=2.0)
    lrs = _lrs(cfg, 64, 8)
    expected = [2.0 * 64**-0.5 * min(s**-0.5, s * 4**-1.5) for s in range(1, 9)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_scheduler_cosine_reaches_min_lr_at_the_last_steps():
    cfg = TrainConfig(schedule="cosine", warmup=0, lr=1e-3, min_lr=1e-4, steps=100)
    lrs = _lrs(cfg, 64, 101)
    assert lrs[0] == pytest.approx(1e-3)
    assert lrs[100] == pytest.approx(1e-4)
    assert lrs[99] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.99)))
