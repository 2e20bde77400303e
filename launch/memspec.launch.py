"""Start memspec_node as a lifecycle node and bring it to active (configure, then activate).

    ros2 launch memspec_ros memspec.launch.py
    ros2 launch memspec_ros memspec.launch.py namespace:=robot1 params_file:=/path/to/memspec.yaml

Auto-activation uses the event-handler pattern that works on Humble and Jazzy alike
(``autostart=True`` is Jazzy-only): emit ChangeState(configure) at start, and when the node
reaches ``inactive``, emit ChangeState(activate), once: an operator who later takes the node down and
configures it again (deactivate, cleanup, set model.*, configure) finds it inactive, as asked. A failed
configure leaves it unconfigured with the reason in its log and on /diagnostics; the first configure that
succeeds after it (the operator's) is still followed by activate.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

from launch import LaunchDescription


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("memspec_ros"), "config", "memspec.yaml")
    node = LifecycleNode(
        package="memspec_ros",
        executable="memspec_node",
        name=LaunchConfiguration("node_name"),
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration("params_file")],
        output="screen",
    )
    configure = EmitEvent(event=ChangeState(
        lifecycle_node_matcher=matches_action(node),
        transition_id=Transition.TRANSITION_CONFIGURE,
    ))
    activate_when_inactive = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node,
        start_state="configuring",
        goal_state="inactive",
        entities=[EmitEvent(event=ChangeState(
            lifecycle_node_matcher=matches_action(node),
            transition_id=Transition.TRANSITION_ACTIVATE,
        ))],
        handle_once=True,  # launch's EventHandler option (Humble and Jazzy alike)
    ))
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("node_name", default_value="memspec", description="name of the node"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS parameter file (see config/memspec.yaml)"),
        node,
        activate_when_inactive,
        configure,
    ])
