"""What a person reads: made from the run folders alone (``eval.records``), never by running a model.

``run_table`` one run's markdown table, comparisons, summary line and speed-quality plot; ``html_page`` the
``report.html`` of a run or sweep folder (``templates/``); ``paper_tables`` and ``paper_plots`` the paper-style
tables and trade-off plots over many runs, beside ``published_numbers.csv``; ``evaluation_card`` the protocol of a
run's numbers; ``labels`` method labels as the papers write them; ``sweep_status`` where a sweep stands.
"""
