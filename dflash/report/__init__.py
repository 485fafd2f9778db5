"""Stage `report`: the run in one self-contained HTML page, and the figures of the stages that run a model.

  charts.py     the pilot sweep, training loss and accuracy by position, eval acceptance per prompt set, drawn
                from the plot data those stages write (a figure change never reruns them)
  run_info.py   the commit, the machine, the params that differ from the committed ones, dvc.lock identities
  page.py       the HTML page: headline, figures as data URIs, markdown reports, metrics, params, stages, files
  stage.py      run: render the figures, gather everything, write report.html

May import: dflash.core only. No torch (it runs wherever the reports are).
"""
