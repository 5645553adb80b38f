/* The collectives' check with no Python around it: what its messages cost MPI itself.
 *
 * Built and run by scripts/bench_check_floor.py (which says how). An in-place all-gather of BYTES
 * (each rank's block BYTES / N) in three forms, timed in interleaved rounds, each round's block of
 * calls timed by its slowest rank:
 *   mpi        MPI_Iallgather + MPI_Wait: what zerompi's unchecked all-gather calls;
 *   checked    the checked all-gather as comm/checked.py's Plan makes it: persistent requests for
 *              every peer's header (HB bytes, its own tag) and data (another tag), one MPI_Startall,
 *              the header receives waited, the headers compared, then the rest waited;
 *   data_only  the same persistent exchange without the headers.
 * Prints one JSON object per size: the median of each form's per-call time (microseconds) and the
 * per-round ratios' median (checked / mpi).
 *
 * usage: bench_check_floor HEADER_BYTES ROUNDS SECONDS_PER_BLOCK BYTES...
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MPI_FORM, CHECKED, DATA_ONLY, FORMS };
static const char *NAMES[FORMS] = {"mpi", "checked", "data_only"};

typedef struct {
    char *buf, *headers, *expected;
    size_t block, hb;
    int n, me, nreq, nheads;
    MPI_Request *all, *data;
    MPI_Comm link;
} exchange_t;

static void setup(exchange_t *x, size_t bytes, size_t hb, MPI_Comm link)
{
    MPI_Comm_size(link, &x->n);
    MPI_Comm_rank(link, &x->me);
    x->block = bytes / x->n;
    x->hb = hb;
    x->link = link;
    x->buf = malloc(x->block * x->n);
    memset(x->buf, 1, x->block * x->n);
    x->headers = calloc(x->n, hb);
    x->expected = calloc(x->n, hb);
    int peers = x->n - 1, k = 0, d = 0;
    x->nheads = peers;
    x->nreq = 4 * peers;
    x->all = malloc(sizeof(MPI_Request) * x->nreq);
    x->data = malloc(sizeof(MPI_Request) * 2 * peers);
    for (int p = 0; p < x->n; p++)       /* header receives first: waited and compared before the rest */
        if (p != x->me)
            MPI_Recv_init(x->headers + p * hb, (int)hb, MPI_BYTE, p, 0, link, &x->all[k++]);
    for (int p = 0; p < x->n; p++)
        if (p != x->me) {
            MPI_Send_init(x->headers + x->me * hb, (int)hb, MPI_BYTE, p, 0, link, &x->all[k++]);
            MPI_Recv_init(x->buf + p * x->block, (int)x->block, MPI_BYTE, p, 1, link, &x->all[k++]);
            MPI_Send_init(x->buf + x->me * x->block, (int)x->block, MPI_BYTE, p, 1, link, &x->all[k++]);
            MPI_Recv_init(x->buf + p * x->block, (int)x->block, MPI_BYTE, p, 2, link, &x->data[d++]);
            MPI_Send_init(x->buf + x->me * x->block, (int)x->block, MPI_BYTE, p, 2, link, &x->data[d++]);
        }
}

static void teardown(exchange_t *x)
{
    for (int k = 0; k < x->nreq; k++)
        MPI_Request_free(&x->all[k]);
    for (int k = 0; k < 2 * (x->n - 1); k++)
        MPI_Request_free(&x->data[k]);
    free(x->all); free(x->data); free(x->buf); free(x->headers); free(x->expected);
}

static void call(exchange_t *x, int form)
{
    if (form == MPI_FORM) {
        MPI_Request r;
        MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, x->buf, (int)x->block, MPI_BYTE, MPI_COMM_WORLD, &r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
    } else if (form == CHECKED) {
        MPI_Startall(x->nreq, x->all);
        MPI_Waitall(x->nheads, x->all, MPI_STATUSES_IGNORE);
        if (memcmp(x->headers, x->expected, x->n * x->hb) != 0) {
            fprintf(stderr, "bench_check_floor: headers differ\n");
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        MPI_Waitall(x->nreq - x->nheads, x->all + x->nheads, MPI_STATUSES_IGNORE);
    } else {
        MPI_Startall(2 * (x->n - 1), x->data);
        MPI_Waitall(2 * (x->n - 1), x->data, MPI_STATUSES_IGNORE);
    }
}

/* One block of ``reps`` calls; the slowest rank's time per call, in seconds. */
static double block(exchange_t *x, int form, int reps)
{
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    for (int i = 0; i < reps; i++)
        call(x, form);
    t = (MPI_Wtime() - t) / reps;
    double slowest;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, n, sizeof *v, by_value);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    if (argc < 5) {
        fprintf(stderr, "usage: %s HEADER_BYTES ROUNDS SECONDS_PER_BLOCK BYTES...\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t hb = strtoul(argv[1], NULL, 10);
    int rounds = atoi(argv[2]);
    double seconds = atof(argv[3]);
    MPI_Comm link;
    MPI_Comm_dup(MPI_COMM_WORLD, &link);
    for (int s = 4; s < argc; s++) {
        exchange_t x;
        setup(&x, strtoul(argv[s], NULL, 10), hb, link);
        for (int f = 0; f < FORMS; f++)           /* warm-up: buffers and connections */
            for (int i = 0; i < 3; i++)
                call(&x, f);
        int reps = (int)(seconds / block(&x, MPI_FORM, 3)) + 1;
        reps = reps < 3 ? 3 : reps > 5000 ? 5000 : reps;
        double *t = malloc(sizeof(double) * FORMS * rounds), *ratio = malloc(sizeof(double) * rounds);
        for (int r = 0; r < rounds; r++) {
            for (int k = 0; k < FORMS; k++) {     /* the forms' order turns every round */
                int f = (k + r) % FORMS;
                t[f * rounds + r] = block(&x, f, reps);
            }
            ratio[r] = t[CHECKED * rounds + r] / t[MPI_FORM * rounds + r];
        }
        if (x.me == 0) {
            printf("{\"bytes\": %zu, \"ranks\": %d, \"header_bytes\": %zu, \"rounds\": %d, \"calls_per_block\": %d",
                   x.block * x.n, x.n, hb, rounds, reps);
            for (int f = 0; f < FORMS; f++)
                printf(", \"%s_us\": %.4f", NAMES[f], 1e6 * median(t + f * rounds, rounds));
            printf(", \"ratio\": %.5f}\n", median(ratio, rounds));
            fflush(stdout);
        }
        free(t); free(ratio);
        teardown(&x);
    }
    MPI_Comm_free(&link);
    MPI_Finalize();
    return 0;
}
