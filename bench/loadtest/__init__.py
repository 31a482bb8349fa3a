"""`pdserve loadtest`: an OpenAI-API load tester in the manner of `vllm bench serve`.

Files, one concept each:
- datasets.py: the prompts (random, ShareGPT, shared-prefix) as SampleRequest lists;
- arrivals.py: when each request is sent (Poisson / gamma / all at once);
- client.py: one streamed request over aiohttp, timed chunk by chunk;
- metrics.py: TTFT, TPOT, ITL, E2EL, throughput, goodput and SLO attainment;
- runner.py: one benchmark run (pacing, concurrency cap, time limit, Ctrl-C);
- report.py: the printed table and the JSON result (vLLM's key names);
- sweep.py: a run per request rate and the PNG plots;
- cli.py: the `pdserve loadtest` subcommand.
"""
