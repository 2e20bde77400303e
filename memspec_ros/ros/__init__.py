"""The ROS 2 layer: the only part of memspec_ros that imports rclpy (besides the action and soak benches, whose
subject is this node).

It turns Generate goals into runtime calls and runtime statistics into messages
(memspec_interfaces); everything below it runs and is tested without ROS.
"""
