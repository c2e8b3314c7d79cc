"""The run folder on disk: what a run writes and every later reader (resume, tables, report, status) reads back.

``image_records`` per-image records (``records/<decoder>[.rank<r>].jsonl``) and images; ``fingerprints`` what a
decoder's images depend on (``records/<decoder>.fingerprint.json``); ``rank_markers`` each rank's state
(``ranks/rank<k>.json``); ``run_json`` the finished run's ``run.json``, read with today's class paths (``legacy``);
``environment`` the machine and commit a number was measured on; ``tree_size`` what travels with a checkout (the
56 MiB that a copy to an offline GPU node may take, checked by CI).
"""
