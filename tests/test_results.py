"""Tables and figures of runs: the numbers they show and their labelling."""
import json

import matplotlib
import pytest

matplotlib.use('Agg')
import matplotlib.pyplot as plt

from dasktrain import results


def log(rates, accuracies, comm=0.0):
    return [{'epoch': i + 1, 'elapsed_time': 10.0 * (i + 1),
             'images_per_sec': rate, 'validation/main/accuracy': acc,
             'comm_time': comm, 'drift': 1.0 / (i + 1)}
            for i, (rate, acc) in enumerate(zip(rates, accuracies))]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close('all')


def test_read_log_takes_a_list_a_summary_a_folder_or_a_file(tmp_path):
    rows = log([1.0], [0.5])
    (tmp_path / 'log').write_text(json.dumps(rows))
    for run in (rows, {'log': rows}, tmp_path, tmp_path / 'log'):
        assert results.read_log(run) == rows


def test_throughput_leaves_out_the_warm_up_epoch():
    assert results.throughput(log([10.0, 100.0, 200.0], [0, 0, 0])) == 150.0
    assert results.throughput(log([10.0], [0])) == 10.0
    assert results.throughput(log([10.0, 30.0], [0, 0]),
                             skip_first=False) == 20.0


def test_scaling_table_speed_up_and_efficiency():
    table = results.scaling_table({
        1: log([1.0, 100.0], [0, 0]), 4: log([1.0, 300.0], [0, 0])})
    assert table.columns == ['devices', 'images/s', 'speed-up',
                             'scaling efficiency']
    assert table.rows == [[1, 100.0, 1.0, 1.0], [4, 300.0, 3.0, 0.75]]
    assert '| 4 | 300 | 3 | 0.75 |' in table.to_markdown()


def test_summary_table_final_best_and_communication():
    table = results.summary_table({'dg': log([5.0, 7.0, 9.0], [0.3, 0.6, 0.5],
                                            comm=2.0)})
    assert table.rows == [['dg', 3, 0.5, 0.6, 8.0, 30.0, 2.0]]
    assert '<td>dg</td>' in table._repr_html_()


def test_curves_are_titled_labelled_and_in_a_legend():
    runs = {'one': log([1, 1], [0.2, 0.4]), 'two': log([1, 1], [0.3, 0.5])}
    ax = results.plot_curves(runs, x='elapsed_time')
    assert ax.get_title() == \
        'test accuracy (fraction) against elapsed time (s)'
    assert (ax.get_xlabel(), ax.get_ylabel()) == (
        'elapsed time (s)', 'test accuracy (fraction)')
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ['one', 'two']
    assert list(ax.lines[1].get_ydata()) == [0.3, 0.5]


def test_scaling_plot_draws_the_ideal_line_and_keeps_its_title():
    ax = results.plot_scaling({1: log([0, 100.0], [0, 0]),
                              2: log([0, 150.0], [0, 0])},
                             title='Throughput (CPU)', label='one process')
    results.plot_scaling({1: log([0, 80.0], [0, 0]),
                         2: log([0, 160.0], [0, 0])},
                        ax=ax, label='workers', ideal=False)
    ideal, measured, workers = ax.lines
    assert list(ideal.get_ydata()) == [100.0, 200.0]
    assert list(measured.get_ydata()) == [100.0, 150.0]
    assert list(workers.get_ydata()) == [80.0, 160.0]
    assert ax.get_title() == 'Throughput (CPU)'
    assert ax.get_ylabel() == 'training throughput (images/s)'


def test_bars_show_the_mean_per_epoch_each_labelled_zero_too():
    ax = results.plot_bars({'dg': log([1, 1], [0, 0], comm=3.0),
                           'ipm, mix every 100 it.': log([1, 1], [0, 0],
                                                         comm=0.5),
                           'ipm, one-shot': log([1, 1], [0, 0])})
    assert [p.get_width() for p in ax.patches] == [3.0, 0.5, 0.0]
    assert [t.get_text() for t in ax.texts] == ['3', '0.5', '0']
    # Long names along the bars, level: no crowded, rotated labels.
    labels = ax.get_yticklabels()
    assert [t.get_text() for t in labels] == [
        'dg', 'ipm, mix every 100 it.', 'ipm, one-shot']
    assert {t.get_rotation() for t in labels} == {0.0}
    assert ax.get_xlabel() == 'communication time per epoch (s)'


def test_runs_with_the_same_numbers_stay_visible():
    same = log([1, 1, 1], [0.2, 0.4, 0.6])
    runs = {f'run {i}': same for i in range(6)}
    ax = results.plot_curves(runs)
    looks = [(line.get_color(), line.get_linestyle(), line.get_marker())
             for line in ax.lines]
    assert len(set(looks)) == 6
    # Each later line is thinner, with smaller markers, drawn on top: the
    # ones below show around it.
    widths = [line.get_linewidth() for line in ax.lines]
    sizes = [line.get_markersize() for line in ax.lines]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert all(line.get_markerfacecolor() == 'none' for line in ax.lines)


def test_a_run_keeps_its_look_where_it_has_no_values():
    runs = {'dg': [{k: v for k, v in row.items() if k != 'drift'}
                   for row in log([1, 1], [0.2, 0.4])],
            'ipm': log([1, 1], [0.2, 0.4])}
    accuracy = results.plot_curves(runs)
    plt.figure()
    drift = results.plot_curves(runs, y='drift')
    assert [t.get_text() for t in drift.get_legend().get_texts()] == ['ipm']
    assert drift.lines[0].get_color() == accuracy.lines[1].get_color()
    assert drift.lines[0].get_marker() == accuracy.lines[1].get_marker()


@pytest.mark.parametrize('draw', [
    lambda: results.plot_curves({f'run {i}': log([1] * 4, [0.9] * 4)
                                for i in range(4)}),
    lambda: results.plot_scaling({1: log([0, 100.0], [0, 0]),
                                 2: log([0, 150.0], [0, 0])}),
], ids=['curves', 'scaling'])
def test_legends_sit_outside_the_data(draw):
    ax = draw()
    ax.figure.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())


def test_timeline_shows_each_job_waiting_then_running(tmp_path):
    from dasktrain.jobs.job import Job
    jobs = []
    for name, started, ended in [('a', 100.0, 160.0), ('b', 100.0, 150.0),
                                 ('c', 150.0, 200.0), ('d', None, 120.0)]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / 'job.json').write_text(json.dumps(
            {'version': 1, 'id': name, 'name': name,
             'submitted': 100.0 + (name == 'c'), 'gpus': 0,
             'config': {'epochs': 1}}))
        (folder / 'status.json').write_text(json.dumps(
            {'state': 'cancelled' if started is None else 'finished',
             'started': started, 'ended': ended, 'gpus': []}))
        jobs.append(Job(name, folder))
    ax = results.plot_timeline(jobs)
    bars = [(round(p.get_x(), 6), round(p.get_width(), 6), p.get_facecolor())
            for p in ax.patches]
    grey, blue = bars[0][2], bars[1][2]
    assert grey != blue
    assert [b[:2] for b in bars] == [(0, 0), (0, 60), (0, 0), (0, 50),
                                     (1, 49), (50, 50), (0, 20)]
    assert [b[2] for b in bars] == [grey, blue, grey, blue, grey, blue, grey]
    assert [t.get_text() for t in ax.get_yticklabels()] == ['a', 'b', 'c', 'd']
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        'queued', 'running']
    assert ax.get_xlabel() == 'time since the first submission (s)'
    ax.figure.canvas.draw()
    assert not ax.get_legend().get_window_extent().overlaps(
        ax.get_window_extent())


def test_curves_without_a_legend_leave_it_to_their_neighbour():
    ax = results.plot_curves({'one': log([1], [0.5])}, legend=False)
    assert ax.get_legend() is None


def test_timeline_colours_pruned_and_failed_runs(tmp_path):
    from dasktrain.jobs.job import Job
    jobs = []
    for name, state in [('t0', 'finished'), ('t1', 'pruned'),
                        ('t2', 'failed'), ('t3', 'running')]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / 'job.json').write_text(json.dumps(
            {'version': 1, 'id': name, 'name': name, 'submitted': 100.0,
             'gpus': 0, 'config': {'epochs': 1}}))
        (folder / 'status.json').write_text(json.dumps(
            {'state': state, 'started': 100.0,
             'ended': None if state == 'running' else 110.0, 'gpus': []}))
        jobs.append(Job(name, folder))
    ax = results.plot_timeline(jobs)
    runs = [p.get_facecolor() for p in ax.patches][1::2]
    assert runs[0] == runs[3] and len({runs[0], runs[1], runs[2]}) == 3
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        'queued', 'running', 'pruned', 'failed']
