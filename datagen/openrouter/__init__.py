"""The OpenRouter app: generate target responses on OpenRouter within a hard dollar budget
(``python -m datagen.openrouter``). Its modules, each found by name:

- ``cli``: the command line (flags, exit codes); ``run``: one run, top to bottom;
- ``config``: the datagen YAML (GenConfig); ``providers``: which endpoints may serve the model
  and the request's provider rule; ``plan``: ``--plan``'s table and projection;
- ``client``: OpenRouter's API besides chat (endpoints, key usage, generation costs);
  ``requester``: the async chat requests within the budget; ``throttle``: how many are in
  flight (shrinks on 429s); ``progress``: the run's progress line;
- ``ledger``: the spend ledger (its docstring is the on-disk contract); ``key_usage``: the rule
  that prices dead runs' unknown costs from the key's usage counter; ``settle``: earlier runs'
  unknown costs settled by it; ``exclusions``: the provider audit of a run and what it excluded;
  ``report``: the closing lines and the summary.

The chat types it shares with ``datagen.local`` are ``datagen.transcript``'s; the retry policy
is ``datagen.retry``'s; the offline audit is ``python -m datagen.audit``.
"""
