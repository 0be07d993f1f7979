"""The running engine, the roof of engines/: Engine.step() over the scheduler, the model runner and
the parallel and speculative runners, the offline LLM, the AsyncEngine with its grammar gate and
worker, and the one torch thread they step on. Everything else in engines/ sits below it."""
