import re

from dasktrain.cli import main


def test_bench_augment_prints_a_table_of_real_measurements(capsys):
    assert main(['bench', 'augment', '--images', '800', '--chunk', '200',
                 '--repeats', '1', '--trainer-rate', '50000']) == 0
    out = capsys.readouterr().out
    assert out.startswith('dasktrain bench augment')
    assert 'Machine: ' in out and ' cores' in out
    rates = [float(v.replace(',', '')) for v in
             re.findall(r'\| ([\d,.]+) \| images/s \|', out)]
    assert len(rates) == 4 and all(r > 0 for r in rates)
    assert re.search(r'parallel efficiency vs Dask with 1 worker \| \d+ %', out)
