"""The one place the suites share code (a suite imports bench.lib and mosaic, never another suite):

  record   a suite's JSON record (date, commit, machine, GPU, versions, config), saved after
           every part; child processes of a suite; SuiteError
  measure  timing (wall clock, CUDA events, do_bench), canvases, the driver's memory counter
           (mosaic.memory.device_meter) and cudaMemGetInfo samplers, cleanup between parts
  floors   the matrix rate and copy bandwidth measured in the run, a step's FLOPs
  ranks    the multi-process suites' launch environment, rank device and meter, gathering
  engine   every access to MosaicEngine beyond its public calls (the engine is being restructured:
           these functions follow it)"""
