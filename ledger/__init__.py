"""The Postgres run ledger: models, engine/session factories, repositories, pricing, settlement."""
