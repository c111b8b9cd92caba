//! Times WGSL compute kernels read from files: `wgsl-timer a.wgsl b.wgsl …`. Each file says how
//! to run it in comment lines at its top:
//!
//! ```text
//! // BENCH dispatch=32,64,1 flops=1.0995e12
//! // BIND 0 storage bytes=134217728 fill=f16      (random in [-1, 1); or fill=f32, fill=zero)
//! // BIND 3 uniform words=u:8192,f:1.0            (a uniform struct's u32 / f32 fields in order)
//! ```
//!
//! Every kernel is compiled without bounds checks (as hesper's `assume_in_bounds` kernels are),
//! warmed up (2 s the first, 0.5 s the others), then timed 30 times, one pass each, by
//! timestamp queries. Prints the median and least µs, TFLOP/s from `flops`, and a checksum of
//! binding 2 (the same inputs for every file: variants of one kernel must agree).
use std::time::Instant;
use wgpu::util::DeviceExt;

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545F4914F6CDD1D);
        ((v >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// What a file's header lines ask for.
struct Spec {
    dispatch: (u32, u32, u32),
    flops: f64,
    bindings: Vec<(u32, Binding)>,
}

enum Binding {
    Uniform(Vec<u32>),
    Storage { bytes: usize, fill: Fill },
}

#[derive(Clone, Copy)]
enum Fill {
    F16,
    F32,
    Zero,
}

fn parse(src: &str) -> Result<Spec, String> {
    let mut spec = Spec {
        dispatch: (1, 1, 1),
        flops: 0.0,
        bindings: vec![],
    };
    let num = |v: &str, what: &str| {
        v.parse::<f64>()
            .map_err(|_| format!("{what}: `{v}` is not a number"))
    };
    for line in src.lines() {
        let Some(rest) = line.strip_prefix("// ") else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let bad = || format!("bad header line `{line}`");
        match parts.next() {
            Some("BENCH") => {
                for p in parts {
                    match p.split_once('=').ok_or_else(bad)? {
                        ("dispatch", v) => {
                            let d: Vec<u32> = v
                                .split(',')
                                .map(|x| x.parse().map_err(|_| bad()))
                                .collect::<Result<_, _>>()?;
                            let [x, y, z] = d[..] else { return Err(bad()) };
                            spec.dispatch = (x, y, z);
                        }
                        ("flops", v) => spec.flops = num(v, "flops")?,
                        _ => return Err(bad()),
                    }
                }
            }
            Some("BIND") => {
                let index: u32 = parts.next().and_then(|i| i.parse().ok()).ok_or_else(bad)?;
                let binding = match parts.next() {
                    Some("uniform") => {
                        let words = parts
                            .next()
                            .and_then(|w| w.strip_prefix("words="))
                            .ok_or_else(bad)?;
                        let mut data = words
                            .split(',')
                            .map(|w| match w.split_once(':') {
                                Some(("u", v)) => v.parse::<u32>().map_err(|_| bad()),
                                Some(("f", v)) => {
                                    v.parse::<f32>().map(f32::to_bits).map_err(|_| bad())
                                }
                                _ => Err(bad()),
                            })
                            .collect::<Result<Vec<u32>, _>>()?;
                        // A uniform struct's size is a multiple of 16 bytes.
                        data.resize(data.len().div_ceil(4) * 4, 0);
                        Binding::Uniform(data)
                    }
                    Some("storage") => {
                        let (mut bytes, mut fill) = (0, Fill::Zero);
                        for p in parts {
                            match p.split_once('=').ok_or_else(bad)? {
                                ("bytes", v) => bytes = num(v, "bytes")? as usize,
                                ("fill", "f16") => fill = Fill::F16,
                                ("fill", "f32") => fill = Fill::F32,
                                ("fill", "zero") => fill = Fill::Zero,
                                _ => return Err(bad()),
                            }
                        }
                        Binding::Storage { bytes, fill }
                    }
                    _ => return Err(bad()),
                };
                spec.bindings.push((index, binding));
            }
            _ => {}
        }
    }
    if !spec.bindings.iter().any(|(i, _)| *i == 2) {
        return Err("no binding 2 (the output the checksum reads)".into());
    }
    Ok(spec)
}

fn main() {
    let files: Vec<String> = std::env::args().skip(1).collect();
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .expect("no GPU adapter");
    println!("adapter: {:?}", adapter.get_info());
    let features = adapter.features()
        & (wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
    // SAFETY: a measuring tool that asks for the experimental cooperative matrices on purpose.
    let experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: None,
        required_features: features,
        required_limits: adapter.limits(),
        experimental_features,
        ..Default::default()
    }))
    .expect("no device");
    let period = queue.get_timestamp_period() as f64;
    let wait = || {
        device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("device lost")
    };
    let mut first = true;
    for file in files {
        let src = match std::fs::read_to_string(&file) {
            Ok(src) => src,
            Err(e) => {
                println!("{file}: cannot read: {e}");
                continue;
            }
        };
        let spec = match parse(&src) {
            Ok(spec) => spec,
            Err(e) => {
                println!("{file}: {e}");
                continue;
            }
        };
        let (dispatch, flops) = (spec.dispatch, spec.flops);
        let bufs: Vec<(u32, wgpu::Buffer)> = spec
            .bindings
            .iter()
            .map(|(i, binding)| {
                // The same seed for a binding in every file: variants of one kernel agree.
                let mut rng = Rng(0x9E3779B97F4A7C15 ^ (*i as u64 + 1));
                let (contents, usage): (Vec<u8>, _) = match binding {
                    Binding::Uniform(words) => (
                        bytemuck::cast_slice(words).to_vec(),
                        wgpu::BufferUsages::UNIFORM,
                    ),
                    Binding::Storage { bytes, fill } => {
                        let data = match fill {
                            Fill::F16 => bytemuck::cast_slice(
                                &(0..bytes / 2)
                                    .map(|_| half::f16::from_f32(rng.f()))
                                    .collect::<Vec<_>>(),
                            )
                            .to_vec(),
                            Fill::F32 => bytemuck::cast_slice(
                                &(0..bytes / 4).map(|_| rng.f()).collect::<Vec<_>>(),
                            )
                            .to_vec(),
                            Fill::Zero => vec![0u8; *bytes],
                        };
                        (
                            data,
                            wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                        )
                    }
                };
                let buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: &contents,
                    usage,
                });
                (*i, buffer)
            })
            .collect();
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = unsafe {
            device.create_shader_module_trusted(
                wgpu::ShaderModuleDescriptor {
                    label: Some(&file),
                    source: wgpu::ShaderSource::Wgsl(src.as_str().into()),
                },
                wgpu::ShaderRuntimeChecks {
                    bounds_checks: false,
                    ..wgpu::ShaderRuntimeChecks::checked()
                },
            )
        };
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&file),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            println!("{file}: ERROR {e}");
            continue;
        }
        let layout = pipeline.get_bind_group_layout(0);
        let entries: Vec<_> = bufs
            .iter()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: *i,
                resource: b.as_entire_binding(),
            })
            .collect();
        let bg = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &layout,
            entries: &entries,
        });
        let run = |n: u32, qs: Option<&wgpu::QuerySet>| {
            let mut enc = device.create_command_encoder(&Default::default());
            for i in 0..n {
                let tw = qs.map(|q| wgpu::ComputePassTimestampWrites {
                    query_set: q,
                    beginning_of_pass_write_index: Some(2 * i),
                    end_of_pass_write_index: Some(2 * i + 1),
                });
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: tw,
                });
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(dispatch.0, dispatch.1, dispatch.2);
            }
            enc
        };
        // Warm up for ~0.5 s (2 s the first time).
        let warm = if first { 2.0 } else { 0.5 };
        first = false;
        let t0 = Instant::now();
        while t0.elapsed().as_secs_f64() < warm {
            queue.submit([run(10, None).finish()]);
            wait();
        }
        let n = 30u32;
        let qs = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: None,
            ty: wgpu::QueryType::Timestamp,
            count: 2 * n,
        });
        let resolve = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = run(n, Some(&qs));
        enc.resolve_query_set(&qs, 0..2 * n, &resolve, 0);
        enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, 16 * n as u64);
        // Checksum of binding 2: sampled elements.
        let Some((_, out)) = bufs.iter().find(|(i, _)| *i == 2) else {
            unreachable!("parse checks binding 2")
        };
        let out_read = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: out.size(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.copy_buffer_to_buffer(out, 0, &out_read, 0, out.size());
        queue.submit([enc.finish()]);
        read.map_async(wgpu::MapMode::Read, .., |r| r.expect("map the timestamps"));
        out_read.map_async(wgpu::MapMode::Read, .., |r| r.expect("map the timestamps"));
        wait();
        let raw: Vec<u64> =
            bytemuck::cast_slice(&read.get_mapped_range(..).expect("mapped")).to_vec();
        let mut d: Vec<f64> = (0..n as usize)
            .map(|i| raw[2 * i + 1].wrapping_sub(raw[2 * i]) as f64 * period / 1000.0)
            .collect();
        d.sort_by(f64::total_cmp);
        let outv: Vec<f32> =
            bytemuck::cast_slice(&out_read.get_mapped_range(..).expect("mapped")).to_vec();
        let step = (outv.len() / 997).max(1);
        let sum: f64 = outv.iter().step_by(step).map(|x| (*x as f64).abs()).sum();
        let med = d[d.len() / 2];
        println!(
            "{:<40} median {:9.1} µs  min {:9.1}  {:7.1} TFLOP/s  checksum {:.6e}",
            file.rsplit('/').next().unwrap_or(&file),
            med,
            d[0],
            flops / med / 1e6,
            sum
        );
    }
}
