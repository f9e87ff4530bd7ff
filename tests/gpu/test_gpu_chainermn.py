"""ChainerMN's model parallelism on real GPUs, under ``dasktrain launch
--devices 0,1``: GPU arrays rank to rank over NCCL point to point, the
collectives' and means' results on their arrays' devices, the gradients'
mean as one NCCL all-reduce, and an MLP split over two GPUs training as
the whole MLP in one process (float64). Skipped, saying why, without two
GPUs and NCCL."""
from pathlib import Path

import numpy as np
from gpu_marks import needs, needs_nccl
from test_chainermn import launch

RANKS = Path(__file__).resolve().parents[1] / 'chainermn' / 'ranks'


@needs(2)
@needs_nccl
def test_gpu_arrays_go_rank_to_rank_over_nccl(tmp_path):
    code, out, err = launch(tmp_path, 2, [RANKS / 'gpu_messages.py'],
                            '--devices', '0,1', timeout=240)
    assert code == 0, err
    assert 'GPU arrays go rank to rank over NCCL' in err
    assert 'rank 0 ok' in out
    assert 'rank 1 ok' in (tmp_path / 'ranks' / 'rank1.log').read_text()


@needs(2)
@needs_nccl
def test_a_model_split_over_two_gpus_trains_as_the_whole(tmp_path,
                                                         float64):
    from test_chainermn_model import parts, unprefixed
    code, _, err = launch(tmp_path, 2, [RANKS / 'mp_mlp.py', tmp_path, 6,
                                        8, 'gpu'], '--devices', '0,1',
                          timeout=240)
    assert code == 0, err
    whole = parts.train_whole(6, 8)
    got = {}
    for r in (0, 1):
        got.update(unprefixed(dict(np.load(tmp_path / f'rank{r}.npz'))))
    for name in whole:  # GPU and CPU float64 kernels: last bits apart
        np.testing.assert_allclose(got[name], whole[name], rtol=0,
                                   atol=1e-8, err_msg=name)
