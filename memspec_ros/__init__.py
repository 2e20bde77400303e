"""memspec_ros: LLM generation with MemSpec memory-aware multi-draft speculative decoding.

Subpackages (see DESIGN in the README):
  runtime/  the engine, draft cache, predictor and policies; plain Python + torch, no rclpy
  ros/      the ROS 2 layer (lifecycle node, Generate action server, diagnostics)
  zoo/      building the bundled model zoo
  bench/    benchmarks and the paper's figures (the simulator they replay on is runtime/simulator.py)
Importing this package imports nothing heavy: neither torch nor rclpy.
"""
