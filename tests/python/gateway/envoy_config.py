"""Envoy configurations for the gateway test, built as data.

The test needs several front doors at once on free ports, so it builds
them here instead of templating deploy/envoy/envoy.yaml; they are the same
design (that file explains each part): ext_proc with the Endpoint Picker
protocol's processing modes in front of the router, and an `engines`
cluster whose override_host policy follows the endpoint list kvroute
returns in the `envoy.lb` dynamic metadata, with retries walking on to the
fallbacks.

Listeners (each its own port):
* fail_close: `failure_mode_allow: false`; without kvroute the client gets 5xx.
* fail_open:  `failure_mode_allow: true`, against a kvroute cluster that Envoy
  health-checks over gRPC (ext_proc service name, panic threshold 0): with
  streamed bodies Envoy only skips a picker it knows to be down.
* subset listeners: first `envoy.filters.http.set_metadata` puts a fixed
  `x-gateway-destination-endpoint-subset` list into `envoy.lb.subset_hint`,
  which the ext_proc filter forwards to kvroute.

scripts/epp-bench.py builds its two front doors here too: one with the
picker, and one without ext_proc (`epp_cluster=None`) routing round robin to
`round_robin_cluster`, its baseline.
"""

import json
import pathlib
import subprocess

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ACCESS_LOG_FORMAT = (
    "%START_TIME% %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% %RESPONSE_FLAGS% "
    "upstream=%UPSTREAM_HOST% attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% "
    "details=%RESPONSE_CODE_DETAILS% failure=%UPSTREAM_TRANSPORT_FAILURE_REASON% "
    "picked=%REQ(x-gateway-destination-endpoint)% tag=%REQ(x-test-tag)%\n"
)


def socket_address(addr: str) -> dict:
    host, port = addr.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def ext_proc_filter(cluster: str, failure_mode_allow: bool, forward_subset: bool) -> dict:
    metadata = {"receiving_namespaces": {"untyped": ["envoy.lb"]}}
    if forward_subset:
        metadata["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": "5s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": metadata,
        },
    }


def set_subset_filter(subset: list[str]) -> dict:
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{
                "metadata_namespace": "envoy.lb.subset_hint",
                "value": {"x-gateway-destination-endpoint-subset": subset},
            }],
        },
    }


def listener(name: str, addr: str, *, epp_cluster: str | None, failure_mode_allow: bool = False,
             subset: list[str] | None = None, access_log: str | None = None,
             cluster: str = "engines") -> dict:
    """A front door routing to `cluster`; without `epp_cluster`, no ext_proc."""
    filters = []
    if subset is not None:
        filters.append(set_subset_filter(subset))
    if epp_cluster is not None:
        filters.append(ext_proc_filter(epp_cluster, failure_mode_allow,
                                       forward_subset=subset is not None))
    filters.append({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    })
    hcm = {
        "@type": HCM,
        "stat_prefix": name,
        "route_config": {"virtual_hosts": [{
            "name": "engines",
            "domains": ["*"],
            "routes": [{
                "match": {"prefix": "/"},
                "route": {
                    "cluster": cluster,
                    "timeout": "0s",
                    "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": 2},
                },
            }],
        }]},
        "http_filters": filters,
    }
    if access_log:
        hcm["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": access_log,
                "log_format": {"text_format_source": {"inline_string": f"{name} " + ACCESS_LOG_FORMAT}},
            },
        }]
    return {
        "name": name,
        "address": socket_address(addr),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": hcm,
        }]}],
    }


def engines_cluster(endpoints: list[str]) -> dict:
    return {
        "name": "engines",
        "type": "STATIC",
        "connect_timeout": "0.5s",
        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(e)}} for e in endpoints
        ]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{
                    "metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]},
                }],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                    },
                }}]},
            },
        }}]},
    }


def round_robin_cluster(name: str, endpoints: list[str]) -> dict:
    """The same engines as `engines_cluster`, plain round robin (no picker)."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.5s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(e)}} for e in endpoints
        ]}]},
    }


def epp_cluster(name: str, addr: str, health_checked: bool) -> dict:
    cluster = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "0.5s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(addr)}},
        ]}]},
    }
    if health_checked:
        cluster["health_checks"] = [{
            "timeout": "0.5s",
            "interval": "0.5s",
            "no_traffic_interval": "0.5s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }]
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    return cluster


def gateway_config(*, admin: str, epp: str, engines: list[str], fail_close: str, fail_open: str,
                   subsets: dict[str, tuple[str, list[str]]], access_log: str) -> dict:
    """The whole bootstrap: `subsets` maps a listener name to (address, subset)."""
    listeners = [
        listener("fail_close", fail_close, epp_cluster="kvroute_epp", access_log=access_log),
        listener("fail_open", fail_open, epp_cluster="kvroute_epp_checked",
                 failure_mode_allow=True, access_log=access_log),
    ]
    for name, (addr, subset) in subsets.items():
        listeners.append(listener(name, addr, epp_cluster="kvroute_epp", subset=subset,
                                  access_log=access_log))
    return {
        "admin": {"address": socket_address(admin)},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                engines_cluster(engines),
                epp_cluster("kvroute_epp", epp, health_checked=False),
                epp_cluster("kvroute_epp_checked", epp, health_checked=True),
            ],
        },
    }


def write(config: dict, path: pathlib.Path) -> pathlib.Path:
    path.write_text(json.dumps(config, indent=1))
    return path


def validate(envoy: str, path: pathlib.Path) -> None:
    """`envoy --mode validate`: fails the caller with Envoy's own message."""
    out = subprocess.run([envoy, "--mode", "validate", "-c", str(path), "--log-level", "error"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"envoy rejected {path}:\n{out.stdout}\n{out.stderr}")
