//! The config file: the bytes are the TOML text of `serve --config FILE`,
//! folded into the command line as `cli::parse` folds a file
//! (`config::argv_with_config_text`), parsed again by clap with every
//! setting's own parser, then turned into the settings the server derives
//! from it (router, replicas, endpoint allow-list, TLS files).

use clap::{CommandFactory, FromArgMatches};

use crate::{
    cli::{Cli, Command},
    config,
};

pub fn config_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let argv = vec!["kvroute".to_string(), "serve".to_string()];
    let command = Cli::command();
    let Ok(matches) = command.clone().try_get_matches_from(&argv) else {
        return;
    };
    let (Some(("serve", serve_matches)), Some(serve_command)) =
        (matches.subcommand(), command.find_subcommand("serve"))
    else {
        return;
    };
    let Ok(argv) =
        config::argv_with_config_text(serve_command, serve_matches, "fuzz.toml", text, argv)
    else {
        return;
    };
    let Ok(matches) = command.try_get_matches_from(&argv) else {
        return;
    };
    let Ok(Cli {
        command: Command::Serve(serve),
    }) = Cli::from_arg_matches(&matches)
    else {
        return;
    };
    let _ = serve.router_config();
    let _ = serve.cluster.replica();
    let _ = serve.security.endpoint_allow();
    let _ = serve.security.grpc_tls();
    let _ = serve.security.metrics_tls_files();
}
