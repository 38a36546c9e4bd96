"""The live front of many instances: an aiohttp gateway in front of SGLang's router `smg`, carrying requests so that
they can move between workers, and the launcher of workers, router and gateway.

Lives here: app (`Gateway`, `python -m sgl_multilora.gateway.app`: routing through smg's header, `/cluster/stats`,
`/cluster/migrate`), carry (a carried request's stream and its moves), moves (where a moving request goes and how
its KV follows), openai_view (OpenAI completions and chats carried as native requests), launch (`Cluster`: the
processes), cli (`python -m sgl_multilora.cluster`). Not here: the decisions, which are pure Python in
sgl_multilora/cluster/ (adapter placement, MELL's packing, the live balancer's binding, the migration cost model)
and tested without a process. Imports the core, never SGLang; nothing in the core imports this package.
"""
