"""Start memspec_node as a lifecycle node and bring it to active (configure, then activate).

    ros2 launch memspec_ros memspec.launch.py
    ros2 launch memspec_ros memspec.launch.py namespace:=robot1 params_file:=/path/to/memspec.yaml
    ros2 launch memspec_ros memspec.launch.py autostart:=false   # a lifecycle manager drives the transitions
    ros2 launch memspec_ros memspec.launch.py log_level:=debug

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
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from lifecycle_msgs.msg import Transition

from launch import LaunchDescription

# the node's longest shutdown: 30 s for a goal's next iteration, 5 for the results, 1.5 for sending them, margin.
# Its own launch argument: launch's "sigterm_timeout" would apply to every process of a launch including this file
SIGTERM_TIMEOUT = "40"


def generate_launch_description():
    default_params = os.path.join(get_package_share_directory("memspec_ros"), "config", "memspec.yaml")
    node = LifecycleNode(
        package="memspec_ros",
        executable="memspec_node",
        name=LaunchConfiguration("node_name"),
        namespace=LaunchConfiguration("namespace"),
        # use_sim_time goes in the params file (a launch argument for it overrode the file's value with its default)
        parameters=[LaunchConfiguration("params_file")],
        arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
        output="screen",
        # after Ctrl-C, launch's SIGTERM came 5 s on (its default) into the node's own shutdown, which may wait up to
        # 30 s for a running goal's next iteration and 5 s more for queued goals' results: the SIGTERM made it give
        # up the results it was about to send, and launch's SIGKILL followed
        sigterm_timeout=LaunchConfiguration("node_sigterm_timeout"),
    )
    # autostart:=false leaves the node unconfigured for a lifecycle manager (nav2's, say): its own configure would
    # race the launch's, and the loser's invalid transition stopped the manager's bringup. (The node makes no bond:
    # nav2's manager expects one unless given bond_timeout 0.0; not tested here)
    autostart = IfCondition(LaunchConfiguration("autostart"))
    configure = EmitEvent(event=ChangeState(
        lifecycle_node_matcher=matches_action(node),
        transition_id=Transition.TRANSITION_CONFIGURE,
    ), condition=autostart)
    activate_when_inactive = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node,
        start_state="configuring",
        goal_state="inactive",
        entities=[EmitEvent(event=ChangeState(
            lifecycle_node_matcher=matches_action(node),
            transition_id=Transition.TRANSITION_ACTIVATE,
        ))],
        handle_once=True,  # launch's EventHandler option (Humble and Jazzy alike)
    ), condition=autostart)
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("node_name", default_value="memspec", description="name of the node"),
        DeclareLaunchArgument("params_file", default_value=default_params,
                              description="ROS parameter file (see config/memspec.yaml)"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="configure and activate the node at launch (false: leave the transitions"
                                          " to a lifecycle manager)"),
        DeclareLaunchArgument("log_level", default_value="info", description="the node's log level"),
        DeclareLaunchArgument("node_sigterm_timeout", default_value=SIGTERM_TIMEOUT,
                              description="seconds ros2 launch lets the node shut down after Ctrl-C before it sends"
                                          " SIGTERM (the node ends its goals with their results meanwhile)"),
        node,
        activate_when_inactive,
        configure,
    ])
