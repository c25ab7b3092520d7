"""The engine as the HTTP layer sees it: ``AsyncEngine``, request streams, detokenizing, the
``EngineClient`` protocol."""
