"""bench/gpu_vs_torch.py compares the same networks: the PyTorch models it
builds, given the Chainer models' weights, compute the same outputs and
gradients (float64, on the GPU where there is one, else the CPU). Needs
PyTorch (the GPU machines have it; skipped elsewhere, saying so)."""
import sys
from pathlib import Path

import chainer
import chainer.functions as F
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='PyTorch is not installed')
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'bench'))
import gpu_vs_torch  # noqa: E402

from dasktrain.training.models import get_model  # noqa: E402


@pytest.mark.parametrize('train', [False, True])
@pytest.mark.parametrize('name', ['cifar10', 'resnet20'])
def test_the_pytorch_twin_computes_what_chainer_computes(name, train):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32))
    t = rng.integers(0, 10, 4)
    np.random.seed(0)
    with chainer.using_config('dtype', np.float64):
        link = get_model(name, n_classes=10)
        with chainer.using_config('train', False):
            link.predictor(x[:1])
    twin = gpu_vs_torch.torch_models()[name]().double()
    gpu_vs_torch.copy_weights(link.predictor, twin)
    twin.train(train and name == 'resnet20')  # no dropout mask to match
    ty = twin(torch.as_tensor(x))
    loss = torch.nn.functional.cross_entropy(ty, torch.as_tensor(t))
    loss.backward()
    with chainer.using_config('train', train and name == 'resnet20'):
        y = link.predictor(x)
        loss = F.softmax_cross_entropy(y, t.astype(np.int32))
    link.cleargrads()
    loss.backward()
    np.testing.assert_allclose(ty.detach().numpy(), y.array, rtol=1e-9,
                               atol=1e-10)
    grads = {n.replace('/', '.').lstrip('.'): p.grad
             for n, p in link.predictor.namedparams()}
    names = {'W': 'weight', 'b': 'bias', 'gamma': 'weight', 'beta': 'bias'}
    for key, p in twin.named_parameters():
        *mod, leaf = key.split('.')
        ours = [g for n, g in grads.items() if n.rsplit('.', 1)[0] ==
                '.'.join(mod) and names[n.rsplit('.', 1)[1]] == leaf]
        assert len(ours) == 1, key
        np.testing.assert_allclose(p.grad.numpy(), ours[0], rtol=1e-8,
                                   atol=1e-11, err_msg=key)
