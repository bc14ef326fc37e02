"""The trace wing (bottom floor, no torch): a run as plain data (``records``: ``RunTrace``, ``StepTrace``,
``NodeTrace``, ``StopSignal``; JSON with a schema version; the draft sources' names), reading user JSON safely
(``jsonfile``), a run's metrics (``metrics``) and the Plotly figures of a step and a run (``figures``). A trace
replays with no model: in the app, the classroom and a page of its own."""
