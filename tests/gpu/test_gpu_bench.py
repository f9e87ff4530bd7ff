"""bench/gpu.py on real GPUs, briefly: every row measured (NCCL's where
two GPUs and NCCL are), a table headed by the GPUs."""
import re
import subprocess
import sys
from pathlib import Path

from gpu_marks import COUNT, NCCL, needs

SCRIPT = Path(__file__).resolve().parents[2] / 'bench' / 'gpu.py'


@needs(1)
def test_bench_gpu_measures_every_row_briefly():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), '--model', 'tiny', '--batch-size',
         '16', '--steps', '2', '--rounds', '1', '--mbytes', '1',
         '--iterations', '2'], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r'^GPUs: \d+ x .+ \(CUDA runtime \d+\.\d+', text,
                     re.MULTILINE)
    for row in ('step, plain Chainer loop, 1 GPU',
                'step, GPUDistributedGradient, 1 GPU',
                'dg step, 2 ranks, 4 MiB buckets, float16 on the wire',
                'dg step, 2 ranks, double buffering (corrected)'):
        ms = re.search(rf'\| {re.escape(row)}[^|]* \| ([\d,.]+) \| ms \|',
                       text)
        assert ms and float(ms.group(1).replace(',', '')) > 0, row
    if COUNT > 1 and NCCL:
        assert re.search(r'\| NCCL all-reduce, 1 MB of float32, 2 GPUs \| '
                         r'[\d,.]+ \| ms \|', text)
    else:
        assert 'NCCL all-reduce, 1 MB, 2 GPUs | skipped: ' in text
