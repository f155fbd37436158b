/* nn_named_tensors: ts_module_named_tensors lists the state dict's names
 * in its order, each with the module's own slot (a tied tensor under each
 * of its names), and a buffer flagged as one. */
#include <criterion/criterion.h>
#include <string.h>

#include "nn/nn.h"
#include "tests/helpers.h"

/* A module of its own: a parameter "w" (2), a buffer "steps" (0-d) and a
 * child Linear(2, 3) "fc" (slots declared, no visit). */
typedef struct holder {
    ts_module base;
    ts_tensor *w, *steps;
    ts_module *fc;
} holder;
static const ts_module_vtable holder_vt = {.type_name = "Holder"};

static ts_module *holder_new(void)
{
    ts_module *m = NULL;
    int64_t two = 2;
    TH_OK(ts_module_new(sizeof(holder), &holder_vt, &m));
    holder *h = (holder *)m;
    TH_OK(ts_module_param_new(m, "w", TS_F32, 1, &two, &h->w));
    TH_OK(ts_module_buffer_new(m, "steps", TS_I64, 0, NULL, &h->steps));
    TH_OK(ts_module_register_child(m, "fc", &h->fc));
    TH_OK(ts_linear_new(2, 3, true, &h->fc));
    return m;
}

Test(nn_named_tensors, state_dict_order_with_the_slots)
{
    ts_gpt_config c = ts_gpt_config_default();
    c.vocab_size = 11;
    c.block_size = 4;
    c.n_layer = 1;
    c.n_head = 2;
    c.d_model = 8;
    c.tie_weights = true;
    ts_module *m = NULL, *hm = holder_new();
    TH_OK(ts_gpt_new(&c, &m));
    ts_tensor *p = NULL;

    ts_named_params nt;
    ts_state_dict *sd = NULL;
    TH_OK(ts_module_named_tensors(m, &nt));
    TH_OK(ts_module_state_dict(m, &sd));
    cr_assert_eq(nt.n, ts_state_dict_size(sd));
    bool tied = false;
    for (int i = 0; i < nt.n; i++) {
        cr_assert_str_eq(nt.items[i].name, ts_state_dict_name(sd, i));
        TH_OK(ts_module_get_parameter(m, nt.items[i].name, &p));
        cr_assert_eq(*nt.items[i].slot, p, "%s: not the module's own tensor", nt.items[i].name);
        cr_assert(!nt.items[i].is_buffer);
        tied |= !strcmp(nt.items[i].name, "lm_head.weight");
    }
    cr_assert(tied, "the tied lm_head.weight is listed under its own name too");
    ts_named_params_free(&nt);
    ts_state_dict_free(sd);

    /* per module: its parameters, its buffers, then its children */
    holder *h = (holder *)hm;
    TH_OK(ts_module_named_tensors(hm, &nt));
    cr_assert_eq(nt.n, 4);
    static const char *const names[] = {"w", "steps", "fc.weight", "fc.bias"};
    for (int i = 0; i < 4; i++) cr_assert_str_eq(nt.items[i].name, names[i]);
    cr_assert(!nt.items[0].is_buffer && nt.items[1].is_buffer && !nt.items[2].is_buffer);
    cr_assert_eq(nt.items[0].slot, &h->w, "the parameter's slot itself");
    cr_assert_eq(nt.items[1].slot, &h->steps, "the buffer's slot itself");
    ts_named_params_free(&nt);
    cr_assert_eq(ts_module_named_tensors(NULL, &nt), TS_ERR_INVALID_ARGUMENT);
    ts_module_free(hm);
    ts_module_free(m);
}
